"""Copy/compute synchronisation bookkeeping, tested on the CPU through the same Copier interface."""

import pytest
import torch

from fate_edge import GenerateConfig
from fate_edge.apps.cli import main
from fate_edge.errors import FateEdgeError
from fate_edge.fetch.transfer import Copier, CPUCopier, make_copier
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine, resolve_device
from fate_edge.runtime.engine_config import EngineConfig


class FakeEvent:
    """Stands in for a CUDA event that completes when the test says so."""

    def __init__(self):
        self.done = False
        self.synced = False

    def query(self):
        return self.done

    def synchronize(self):
        self.synced = self.done = True


def test_staging_buffer_released_only_after_its_copy_completes():
    c = Copier()
    released = []
    ev = FakeEvent()
    c.release_after(ev, lambda: released.append("a"))
    c.release_after(None, lambda: released.append("b"))  # a copy that finished synchronously
    assert released == ["b"] and c.poll() == 1
    ev.done = True
    assert c.poll() == 0 and released == ["b", "a"]


def test_drain_waits_for_outstanding_copies():
    c = Copier()
    events = [FakeEvent() for _ in range(3)]
    released = []
    for i, ev in enumerate(events):
        c.release_after(ev, lambda i=i: released.append(i))
    c.drain()
    assert sorted(released) == [0, 1, 2] and all(ev.synced for ev in events) and not c.in_flight


def test_cpu_copier_copies_out_of_the_buffer():
    buf = bytearray(b"\x01\x02\x03\x04")
    t, ev = CPUCopier().upload(memoryview(buf), demand=True)
    buf[0] = 99  # the pool reuses the buffer: the uploaded copy must not change
    assert ev is None and t.tolist() == [1, 2, 3, 4]
    assert isinstance(make_copier("cpu"), CPUCopier)


def test_each_copy_is_timed_once_for_the_links_speed():
    copier = CPUCopier()
    copier.upload(memoryview(bytearray(1 << 20)), demand=True)
    copier.upload(memoryview(bytearray(4096)), demand=False)
    [(a, ta), (b, tb)] = copier.timings()
    assert (a, b) == (1 << 20, 4096) and ta > 0 and tb > 0
    assert copier.timings() == []  # read once


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("transfer") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


def test_engine_returns_every_staging_buffer_and_counts_them_in_the_budget(store):
    with Engine(EngineConfig(store, "2MB", "fate")) as e:
        e.generate_text("def f(x):", GenerateConfig(max_tokens=16, ignore_eos=True))
        assert not e.scheduler.copier.in_flight
        assert e.fetch.pool.available == e.fetch.pool.count  # nothing leaked
        assert e.plan.pool_bytes == e.fetch.pool.nbytes  # staging buffers are inside the budget
        assert e.plan.pool_bytes + e.plan.cache_bytes + e.plan.working_bytes <= e.budget
        # Every fetched expert was copied out of its buffer once, kept in it as the cached expert (zero-copy), or
        # computed in it and not kept (the buffer lent for that use).
        assert e.fetch.pool.handed_off > 0
        assert (
            e.scheduler.copier.uploads + e.fetch.pool.handed_off + e.scheduler.lent_reads
            == e.stats.misses + e.stats.prefetch_hits
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_without_a_gpu_fails_at_once_with_a_clear_message(store, capsys):
    with pytest.raises(FateEdgeError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(FateEdgeError, match="no CUDA GPU"):
        Engine(EngineConfig(store, "2MB", "lru", device="cuda"))
    assert main(["run", "--device", "cuda", "--max-tokens", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err
    assert resolve_device("auto") == "cpu"
