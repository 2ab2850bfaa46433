"""convert at real scale: streaming memory, progress, and a store byte-identical to the reference encoders'."""

import weakref
from pathlib import Path

import pytest
import torch
from _rtn_reference import reference_pack, reference_quantize
from safetensors.torch import save_file
from test_convert_hardening import width96  # noqa: F401 (fixture: a fused-layout fp32 checkpoint)

import fate_edge.format.checkpoint as checkpoint
import fate_edge.format.convert as conv
import fate_edge.format.store as store
from fate_edge.format.checkpoint import CheckpointReader, save_streaming
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore

OPTION_SETS = {
    "int4+int2+bf16": ConvertOptions.full(bits=4, cold_bits=2),
    "portable int4": ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"),
    "int8": ConvertOptions.full(bits=8, keep_bf16=False),
}


def _files(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir()) if f.is_file()}


def _reference_convert(monkeypatch, model, out, opts):
    """convert with the reference pieces it used before streaming: the textbook RTN encoder and packer on fp32
    copies, and all resident tensors loaded at once into safetensors' save_file."""
    with monkeypatch.context() as m:
        m.setattr(store, "quantize_with", lambda method, w, spec, work=None: reference_quantize(w.float(), spec))
        m.setattr(store, "pack", reference_pack)

        def save_all(reader, names, path, metadata=None, on_tensor=None):
            save_file({n: reader.get(n) for n in names}, str(path), metadata=metadata)
            for n in names:
                on_tensor(n, reader.nbytes(n))

        m.setattr(conv, "save_streaming", save_all)
        return convert(model, out, opts, progress=False)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_store_is_byte_identical_to_the_reference_encoders(name, monkeypatch, tmp_path, bundled_dir):
    ref = _reference_convert(monkeypatch, bundled_dir, tmp_path / "ref", OPTION_SETS[name])
    fast = convert(bundled_dir, tmp_path / "fast", OPTION_SETS[name], progress=False)
    a, b = _files(ref), _files(fast)
    assert sorted(a) == sorted(b)
    assert [n for n in a if a[n] != b[n]] == []


@pytest.fixture(scope="module")
def fused96(tmp_path_factory, width96):  # noqa: F811
    """width96 (fp32, per-expert tensors) rewritten in the transformers-5 fused layout."""
    import shutil

    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("fused") / "model"
    shutil.copytree(width96, out)
    w = load_file(str(width96 / "model.safetensors"))
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(4)
        w[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([w.pop(f"{p}.{e}.gate_proj.weight"), w.pop(f"{p}.{e}.up_proj.weight")]) for e in experts]
        )
        w[f"{p}.down_proj"] = torch.stack([w.pop(f"{p}.{e}.down_proj.weight") for e in experts])
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("model", ["width96", "fused96"])
def test_fp32_checkpoints_per_expert_and_fused_convert_to_the_reference_bytes(model, request, monkeypatch, tmp_path):
    src = request.getfixturevalue(model)
    opts = ConvertOptions.full(bits=4, cold_bits=2, cold_group_size=32)
    ref = _reference_convert(monkeypatch, src, tmp_path / "ref", opts)
    fast = convert(src, tmp_path / "fast", opts, progress=False)
    a, b = _files(ref), _files(fast)
    assert [n for n in a if a[n] != b[n]] == [] and sorted(a) == sorted(b)
    assert len(ExpertStore(fast).refs) == 2 * 4 * 3  # layers x experts x (bf16, int4, int2)
    assert ("model.layers.0.mlp.experts.gate_up_proj" in CheckpointReader(src)) == (model == "fused96")


def test_worker_count_does_not_change_the_store(tmp_path, bundled_dir):
    one = convert(bundled_dir, tmp_path / "one", ConvertOptions.full(bits=4, cold_bits=2, threads=1), progress=False)
    three = convert(
        bundled_dir, tmp_path / "three", ConvertOptions.full(bits=4, cold_bits=2, threads=3), progress=False
    )
    assert _files(one) == _files(three)


def test_streaming_safetensors_writer_matches_save_file(tmp_path, monkeypatch):
    torch.manual_seed(0)
    tensors = {
        "emb": torch.randn(300, 40).to(torch.bfloat16),
        "norm": torch.ones(40),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "q": torch.randint(0, 255, (33, 9), dtype=torch.uint8),
        "half": torch.randn(5, 3).half(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 1000)  # the 24 kB "emb" goes in 25-row blocks
    seen = []
    save_streaming(
        CheckpointReader(src),
        sorted(tensors),
        tmp_path / "out.safetensors",
        {"format": "pt"},
        lambda n, nbytes: seen.append(n),
    )
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(seen) == sorted(tensors)


class _LiveTensors:
    """Every tensor the checkpoint reader hands out, tracked by weak reference: the most bytes alive at once."""

    def __init__(self, monkeypatch):
        self.live: list[tuple[weakref.ref, int]] = []
        self.peak = 0
        for method in ("get", "get_row", "get_rows"):
            real = getattr(CheckpointReader, method)
            monkeypatch.setattr(CheckpointReader, method, self._wrap(real))

    def _wrap(self, real):
        def read(reader, *args, **kwargs):
            t = real(reader, *args, **kwargs)
            self.live = [(r, n) for r, n in self.live if r() is not None]
            self.live.append((weakref.ref(t), t.numel() * t.element_size()))
            self.peak = max(self.peak, sum(n for _, n in self.live))
            return t

        return read


def test_convert_holds_a_few_experts_or_one_tensor_block_never_the_model(monkeypatch, tmp_path, bundled_dir):
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 1 << 16)
    reader = CheckpointReader(bundled_dir)
    expert = sum(reader.nbytes(n) for n in reader.keys() if ".experts.0." in n and ".layers.0." in n)
    largest = max(reader.nbytes(n) for n in reader.keys())
    resident = sum(reader.nbytes(n) for n in reader.keys() if ".experts." not in n)
    live = _LiveTensors(monkeypatch)
    threads = 2
    convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, cold_bits=2, threads=threads), progress=False)
    # in flight: 2 x threads experts queued, plus one being read; and, written beside them, one block of rows of a
    # resident tensor
    bound = (2 * threads + 1) * expert + (1 << 16) + largest // 64
    assert 0 < live.peak <= bound < resident, (live.peak, bound, resident)


def test_progress_counts_every_checkpoint_byte_once_in_order(tmp_path, bundled_dir):
    calls = []
    convert(
        bundled_dir,
        tmp_path / "s",
        ConvertOptions.full(bits=4, keep_bf16=False),
        progress=False,
        on_progress=lambda done, total: calls.append((done, total)),
    )
    reader = CheckpointReader(bundled_dir)
    total = sum(reader.nbytes(n) for n in reader.keys())
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert all(b > a for a, b in zip(done, done[1:])) and done[-1] == total
    experts = sum(1 for n in reader.keys() if n.endswith(".gate_proj.weight") and ".experts." in n)
    assert len(calls) > experts  # one call per expert, plus the resident tensors'


@pytest.mark.slow
def test_opening_a_store_makes_freed_expert_blobs_leave_the_resident_set(tmp_path, bundled_dir):
    """At real shapes RSS grew ~50 MB per token: freed blobs stayed in glibc's heap (see store.py)."""
    import subprocess
    import sys

    store_dir = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    code = f"""
import torch
from fate_edge.format.store import ExpertStore
def anon():
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("RssAnon"))
ExpertStore({str(store_dir)!r})
first = torch.ones(4_600_000, dtype=torch.uint8)
del first  # a first large free: glibc would raise its mmap threshold
base = anon()
blobs, small = [], []
for _ in range(100):  # expert-sized blobs interleaved with small long-lived allocations, as in decoding
    blobs.append(torch.ones(4_600_000, dtype=torch.uint8))
    small.append(torch.ones(2000, dtype=torch.uint8))
del blobs
print(anon() - base)
"""
    kept = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert kept < 46_000_000  # under a tenth of the 460 MB freed
