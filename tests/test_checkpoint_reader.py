"""CheckpointReader reads tensors with pread: the same tensors safetensors' own reader returns."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fate_edge.format.checkpoint import CheckpointReader


def _reference(path, name):
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("drop_cache", [False, True])
def test_every_tensor_and_row_matches_safetensors(tmp_path, drop_cache):
    torch.manual_seed(0)
    tensors = {
        "bf": torch.randn(6, 5, 4).to(torch.bfloat16),
        "f32": torch.randn(7, 3),
        "i64": torch.arange(5),
        "b": torch.tensor([True, False, True]),
        "h": torch.randn(2, 2).half(),
        "s": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "f8": torch.randn(3, 8).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path, drop_cache=drop_cache)
    for name, t in tensors.items():
        assert _same(reader.get(name), _reference(tmp_path / "model.safetensors", name)), name
        if t.dim() >= 1 and t.shape[0]:
            for i in range(t.shape[0]):
                assert _same(reader.get_row(name, i), t[i].contiguous()), (name, i)
            for start, stop in ((0, 2), (1, 100), (3, 1), (-5, 2)):
                assert _same(reader.get_rows(name, start, stop), t[max(start, 0) : stop].contiguous()), (name, start)
    assert torch.equal(reader.get("f32", torch.float64), tensors["f32"].double())
    with pytest.raises(IndexError, match="out of range"):
        reader.get_row("f32", 7)
    reader.close()


def test_bundled_checkpoint_reads_like_safetensors(bundled_dir):
    reader = CheckpointReader(bundled_dir)
    for name in reader.keys():
        assert _same(reader.get(name), _reference(bundled_dir / reader.weight_map[name], name)), name
