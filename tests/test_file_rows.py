"""format/file_rows.py: rows of a stored tensor read with pread give the tensor's own rows, in the order asked."""

import pytest
import torch
from safetensors.torch import save_file

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.prequantized import MappedFiles


@pytest.fixture()
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.int8": torch.randint(-128, 127, (300, 48), dtype=torch.int8, generator=g),
        "b.codes": torch.randint(0, 255, (300, 24), dtype=torch.uint8, generator=g),
        "c.scale": torch.randn(300, 3, generator=g).to(torch.float16),
        "d.scale": torch.randn(300, generator=g).to(torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "resident.safetensors"))
    return tmp_path, tensors


@pytest.mark.parametrize("name", ["a.int8", "b.codes", "c.scale", "d.scale"])
def test_rows_read_from_the_file_are_the_tensors_rows_in_the_order_asked(stored, name):
    directory, tensors = stored
    rows = MappedFiles(CheckpointReader(directory)).rows(name)
    for ids in ([7], [299, 0, 5, 5, 42, 0], list(range(300))[::-7]):
        got = rows.gather(torch.tensor(ids))
        assert got.dtype == tensors[name].dtype
        assert torch.equal(got, tensors[name][ids])


def test_a_row_outside_the_table_is_an_index_error(stored):
    directory, _ = stored
    rows = MappedFiles(CheckpointReader(directory)).rows("a.int8")
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        rows.gather(torch.tensor([3, 300]))


def test_a_truncated_file_is_a_short_read_naming_it(stored):
    directory, _ = stored
    rows = MappedFiles(CheckpointReader(directory)).rows("d.scale")
    path = directory / "resident.safetensors"
    with open(path, "r+b") as f:  # cut inside the last row
        f.truncate(rows.offset + 299 * rows.row_bytes + 1)
    with pytest.raises(OSError, match="resident.safetensors: short read of row 299"):
        rows.gather(torch.tensor([299]))
