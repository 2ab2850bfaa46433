"""KV ranges that grow as answers are written: a request without max_tokens reserves its prompt and a step's room,
not the whole context, so such requests share the batch; ranges grow in place or move with their keys; when no
range can grow, the sequence holding the most ends at its length and the others go on."""

import threading

import pytest
import torch

from fate_edge import Engine, GenerateConfig
from fate_edge.model.kv_slab import KVSlab
from fate_edge.runtime.batch import ANSWER_ROOM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(bundled_model):
    return bundled_model


def _fill(cache, n: int, value: float) -> None:
    for layer in cache.layers:
        for b in layer.buffers:
            b[:, :, :n] = value
        layer.length = n


def test_a_range_grows_in_place_when_the_next_is_free_else_moves_with_its_keys(model):
    slab = KVSlab(model, 64)
    a, b = slab.allocate(8), slab.allocate(8)
    _fill(a, 8, 1.0)
    _fill(b, 8, 2.0)
    assert slab.grow(b, 20) and b.offset == 8 and b.capacity == 20  # the range after b was free
    assert slab.grow(a, 16) and a.offset == 28 and a.capacity == 16  # b sits after a: a moves past b
    for layer in a.layers:
        assert torch.equal(layer.buffers[0][:, :, :8], torch.ones_like(layer.buffers[0][:, :, :8]))
    assert all(torch.all(held[0][:, :, 0:8] == 0) for held in slab.buffers)  # a's old range was zeroed
    assert slab.free_positions == 64 - 20 - 16
    assert not slab.grow(a, 64) and a.offset == 28 and a.capacity == 16  # no room: unchanged


def _run_together(engine, prompts, cfg):
    out: dict[int, object] = {}
    gate = threading.Barrier(len(prompts))

    def run(i):
        gate.wait()
        steps = list(engine.stream(prompts[i], cfg))
        out[i] = ("".join(s.text for s in steps), len(steps), steps[-1].finish_reason)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_requests_without_max_tokens_share_the_batch_and_end_at_the_room(bundled_dir):
    prompts = ["def main():", "import os\n"]
    context = 2 * ANSWER_ROOM + 64  # room for both to start, not for both to fill the context
    cfg = GenerateConfig(ignore_eos=True)  # greedy; no max_tokens: until the context is full
    with Engine.load(memory_budget="2MB", device="cpu", max_batch=4, context_tokens=context) as engine:
        results = _run_together(engine, prompts, cfg)
        assert engine.batcher.stats.peak_active == 2  # together, not one after the other
        assert engine.batcher.stats.active == 0 and engine.batcher.stats.kv_reserved_bytes == 0
    lengths = sorted(n for _, n, _ in results)
    assert all(f == "length" for _, _, f in results)
    assert lengths[0] < lengths[1]  # the one holding most ended at its length when neither could grow ...
    assert lengths[1] > ANSWER_ROOM  # ... and the other grew past its first reservation


@pytest.mark.slow
def test_growing_ranges_give_each_request_its_alone_text(bundled_dir):
    prompts = ["def main():", "import os\nimport sys\n", "class Point:"]
    cfg = GenerateConfig(max_tokens=ANSWER_ROOM + 40, ignore_eos=True)
    kw = dict(memory_budget="2MB", device="cpu", dtype="float32")
    with Engine.load(max_batch=1, **kw) as alone:
        want = [alone.generate_text(p, cfg)[0] for p in prompts]
    with Engine.load(max_batch=4, context_tokens=4 * (ANSWER_ROOM + 48), **kw) as batched:
        got = _run_together(batched, prompts, cfg)
        assert batched.batcher.stats.peak_active >= 2
    assert [text for text, _, _ in got] == want
