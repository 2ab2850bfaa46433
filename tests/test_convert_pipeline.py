"""convert writes the resident part and the experts at once (the resident part on its own thread, the blobs by
writer threads, a GGUF's experts read in large runs ahead of the encoders): the same store, byte for byte, as the
sequential writer it replaced; a failure on either side stops the other and leaves nothing at the target."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from _gguf_writer import write_gguf
from _sequential_store import sequential_gguf_write_store, sequential_write_store

import fate_edge.format.convert as conv
import fate_edge.format.direct_read as direct_read
import fate_edge.format.gguf_convert as gguf_convert
import fate_edge.format.gguf_expert_reads as expert_reads
from fate_edge.errors import ConvertStopped, FateEdgeError
from fate_edge.format.checkpoint import save_streaming
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.direct_write import DirectFile
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_expert_reads import ExpertReads
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.format.gguf_tensors import expert_tensor
from fate_edge.format.store import MATRICES

TIMEOUT_S = 120  # a convert of the bundled model takes seconds: longer means it hangs


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, bundled_dir) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    # Q4_0 / Q8_0: codes taken as they are; Q5_0 and F16: dequantized and quantized again
    kinds = ("Q4_0", "Q8_0", "Q5_0", "F16")
    return {k: write_gguf(bundled_dir, d / f"tiny-{k.lower()}.gguf", k, "Q8_0") for k in kinds}


def _files(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir()) if f.is_file()}


def _same_files(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    assert [n for n in fa if fa[n] != fb[n]] == []


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _within(timeout: float, fn, *args, **kwargs):
    """``fn(*args)`` on a thread: its result or its exception, failing the test if it has not ended in ``timeout``."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} still running after {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


GGUF_CASES = {
    "q4_0 int4+int2+bf16": ("Q4_0", ConvertOptions.full(bits=None, cold_bits=2)),
    "q8_0 int8": ("Q8_0", ConvertOptions.full(bits=None, keep_bf16=False)),
    "q5_0 int4 again": ("Q5_0", ConvertOptions.full(bits=4, keep_bf16=False)),
    "f16 int4+bf16 resident int8": ("F16", ConvertOptions.full(bits=4, resident_bits=8)),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_store_is_byte_identical_to_the_sequential_writers(case, ggufs, tmp_path, monkeypatch):
    kind, opts = GGUF_CASES[case]
    # runs of 3 experts (16 per layer: the last run of each layer is 1) and little read-ahead: every wait path
    per = GGUFFile(ggufs[kind]).info(expert_tensor(0, "down")).nbytes // 16
    monkeypatch.setattr(expert_reads, "READ_BYTES", 3 * per)
    monkeypatch.setattr(expert_reads, "AHEAD_BYTES", 5 * per)
    ours = _within(TIMEOUT_S, convert_gguf, ggufs[kind], tmp_path / "ours", opts, progress=False)
    with monkeypatch.context() as m:
        m.setattr(gguf_convert, "write_store", sequential_gguf_write_store)
        ref = convert_gguf(ggufs[kind], tmp_path / "ref", opts, progress=False)
    _same_files(ours, ref)


@pytest.mark.parametrize(
    "opts",
    [
        ConvertOptions.full(bits=4, cold_bits=2, threads=3),
        ConvertOptions.full(bits=8, keep_bf16=False, layout="portable", threads=1),
        ConvertOptions.full(bits=4, keep_bf16=False, resident_bits=8, embedding_bits=4),
    ],
    ids=["int4+int2+bf16", "int8", "resident int8"],
)
def test_safetensors_store_is_byte_identical_to_the_sequential_writers(opts, bundled_dir, tmp_path, monkeypatch):
    ours = _within(TIMEOUT_S, convert, bundled_dir, tmp_path / "ours", opts, progress=False)
    with monkeypatch.context() as m:
        m.setattr(conv, "write_store", sequential_write_store)
        ref = convert(bundled_dir, tmp_path / "ref", opts, progress=False)
    _same_files(ours, ref)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_expert_reads_give_every_experts_own_bytes(direct, ggufs, monkeypatch):
    if not direct:  # a filesystem that refuses O_DIRECT: reads through the page cache
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(direct_read.os, "open", no_direct)
    g = GGUFFile(ggufs["Q5_0"])
    layers = [0, 1, 2, 3, 4, 5, 6, 7]
    per = g.info(expert_tensor(0, "gate")).nbytes // 16
    reads = ExpertReads(g, layers, 16, read_bytes=5 * per, ahead_bytes=1)  # runs of 5; read only when asked
    assert reads.run == 5 and len(reads.runs) == 8 * 4
    order = [(layer, e) for layer in layers for e in range(16)]
    order[3], order[9] = order[9], order[3]  # encoders finish out of order
    try:
        for layer, e in order:
            got = reads.expert(layer, e)
            for m in MATRICES:
                assert got[m].tobytes() == g.read_bytes(expert_tensor(layer, m), e, 1).tobytes(), (layer, e, m)
        assert reads._held == 0 and not reads._ready  # every run handed out in full is gone
        with pytest.raises(RuntimeError, match="layer 0 expert 0 asked for twice"):
            reads.expert(0, 0)
    finally:
        reads.close()
    g.close()


def test_a_failure_writing_the_resident_part_leaves_nothing_and_does_not_hang(bundled_dir, tmp_path, monkeypatch):
    started = threading.Event()

    def failing(reader, names, path, metadata=None, on_tensor=None):
        path.write_bytes(b"partial")
        started.set()
        raise RuntimeError("resident part failed")

    encoded = []

    def slow_encode(*args):  # the experts would take much longer than the resident part's failure
        encoded.append(args[1])
        time.sleep(0.05)
        return real_encode(*args)

    real_encode = conv._encode_job
    monkeypatch.setattr(conv, "save_streaming", failing)
    monkeypatch.setattr(conv, "_encode_job", slow_encode)
    out = tmp_path / "out" / "store"
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="resident part failed"):
        _within(TIMEOUT_S, convert, bundled_dir, out, ConvertOptions.full(bits=4, threads=2), progress=False)
    assert started.is_set() and time.perf_counter() - t0 < 30
    assert len(encoded) < 8 * 16  # stopped early, not after every expert
    assert _leftovers(out.parent) == []


def test_a_failure_on_the_experts_side_stops_the_resident_part(bundled_dir, tmp_path, monkeypatch):
    ends = []

    def endless(reader, names, path, metadata=None, on_tensor=None):  # a resident part that never ends by itself
        try:
            while True:
                for n in names:
                    reader.get(n)
                time.sleep(0.01)
        except ConvertStopped:
            ends.append("stopped")
            raise

    def failing_encode(layout, expert, precisions, method):
        if expert == 5:
            raise ValueError("expert 5 failed")
        return real_encode(layout, expert, precisions, method)

    real_encode = conv._encode_job
    monkeypatch.setattr(conv, "save_streaming", endless)
    monkeypatch.setattr(conv, "_encode_job", failing_encode)
    with pytest.raises(ValueError, match="expert 5 failed"):
        _within(TIMEOUT_S, convert, bundled_dir, tmp_path / "store", ConvertOptions.full(bits=4), progress=False)
    assert ends == ["stopped"]
    assert _leftovers(tmp_path) == []


def test_a_disk_full_in_a_blob_writer_is_the_one_error_and_leaves_nothing(bundled_dir, tmp_path, monkeypatch):
    real = DirectFile.pwrite_at
    calls = []

    def full_on_the_fifth(self, data, offset, staging=None):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, offset, staging)

    monkeypatch.setattr(DirectFile, "pwrite_at", full_on_the_fifth)
    with pytest.raises(FateEdgeError, match="no space left"):
        _within(TIMEOUT_S, convert, bundled_dir, tmp_path / "store", ConvertOptions.full(bits=4), progress=False)
    assert _leftovers(tmp_path) == []


def test_the_resident_part_runs_beside_the_experts_on_one_torch_thread(bundled_dir, tmp_path, monkeypatch):
    """The resident writer waits for the experts' encoders to have started: written one after the other, this
    would not end. While the experts run it computes on one torch thread, afterwards on the process's count."""
    experts_started = threading.Event()
    seen: dict[str, int] = {}

    def after_experts_start(reader, names, path, metadata=None, on_tensor=None):
        assert experts_started.wait(30), "the experts did not start while the resident part was being written"
        seen["during"] = torch.get_num_threads()
        deadline = time.monotonic() + 30
        while torch.get_num_threads() != before and time.monotonic() < deadline:
            reader.get(names[0])  # the first read after the experts are done takes the process's threads
            time.sleep(0.01)
        seen["after"] = torch.get_num_threads()
        return save_streaming(reader, names, path, metadata, on_tensor)

    def encode(*args):
        experts_started.set()
        return real_encode(*args)

    real_encode = conv._encode_job
    monkeypatch.setattr(conv, "save_streaming", after_experts_start)
    monkeypatch.setattr(conv, "_encode_job", encode)
    before = torch.get_num_threads()
    opts = ConvertOptions.full(bits=4, keep_bf16=False)
    ours = _within(TIMEOUT_S, convert, bundled_dir, tmp_path / "ours", opts, progress=False)
    assert seen == {"during": 1, "after": before}
    assert torch.get_num_threads() == before
    monkeypatch.setattr(conv, "write_store", sequential_write_store)
    _same_files(ours, convert(bundled_dir, tmp_path / "ref", opts, progress=False))
