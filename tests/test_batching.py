"""Continuous batching (runtime/batch.py, model/batch_step.py): one forward over every active sequence, each
sequence's text the same as alone, the batch's experts unioned and read once, KV caches inside the budget."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fate_edge import Engine, GenerateConfig
from fate_edge.errors import BudgetError, EngineClosedError
from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.model.experts import InMemoryExpertProvider

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "def main():",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x",
    "x = ",
    "# read the file line by line\n",
    "for i in range(10):",
]


def _cfg(n: int, **kw) -> GenerateConfig:
    return GenerateConfig(max_tokens=n, ignore_eos=True, **kw)


def _interleaved(engine: Engine, requests: list[tuple[str, GenerateConfig]], lead: int = 3) -> list[str]:
    """Open the streams one after another, reading ``lead`` tokens of every open one before opening the next (so
    each joins a running batch at a later step), then read them all round-robin to their ends."""
    streams, texts = [], []
    for prompt, cfg in requests:
        streams.append(engine.stream(prompt, cfg))
        texts.append([])
        for s, t in zip(streams, texts):
            for _ in range(lead):
                step = next(s, None)
                if step is not None:
                    t.append(step.text)
    open_ = list(range(len(streams)))
    while open_:
        for i in list(open_):
            step = next(streams[i], None)
            if step is None:
                open_.remove(i)
            else:
                texts[i].append(step.text)
    return ["".join(t) for t in texts]


@pytest.fixture(scope="module", params=["load-on-demand", "fate-edge"])
def engines(request, baseline_store):
    """fp32 engines on the bundled model: one serving requests alone, one batching (bf16 experts read and computed
    in fp32 with load-on-demand, from the store that keeps them; int4 experts with fate-edge, the default store)."""
    # no prompt cache: each engine's text depends on the prompts alone, not on what earlier tests left kept (int4
    # experts compute an expert's rows by how many it gets, so a kept prefix computed in another step can tip a near
    # tie; tests/test_prompt_cache.py covers the cache)
    kw = dict(memory_budget="2MB", device="cpu", policy=request.param, dtype="float32", prompt_cache=0)
    path = baseline_store if request.param == "load-on-demand" else None
    with Engine.load(path, max_batch=1, **kw) as alone, Engine.load(path, max_batch=4, **kw) as batched:
        yield alone, batched


def test_forward_segments_matches_one_forward_per_sequence(bundled_model, bundled_tokenizer):
    ids = [bundled_tokenizer.encode(p) for p in PROMPTS[:3]]
    segs = [Segment(i, bundled_model.new_cache()) for i in ids]
    batched = forward_segments(bundled_model, segs)
    for i, (row, seg) in enumerate(zip(batched, segs)):
        cache = bundled_model.new_cache()
        alone = bundled_model(torch.tensor([ids[i]]), cache, last_only=True)[0, -1]
        assert torch.allclose(row, alone, atol=1e-4, rtol=1e-4)
        assert seg.cache.length == cache.length == len(ids[i])
        for a, b in zip(seg.cache.layers, cache.layers):  # each sequence's own keys and values
            assert torch.allclose(a.buffers[0][:, :, : a.length], b.buffers[0][:, :, : b.length], atol=1e-5)


def test_greedy_text_is_the_same_alone_or_batched_at_fp32(engines):
    alone, batched = engines
    requests = [(p, _cfg(8 + 5 * i)) for i, p in enumerate(PROMPTS)]  # different lengths; 6 requests, 4 places
    expected = [alone.generate_text(p, c)[0] for p, c in requests]
    before = batched.batcher.stats.steps, batched.batcher.stats.sequences_stepped
    assert _interleaved(batched, requests) == expected
    steps = batched.batcher.stats.steps - before[0]
    stepped = batched.batcher.stats.sequences_stepped - before[1]
    assert stepped > 2 * steps  # the sequences really ran together (more than two a step on average)
    assert batched.batcher.stats.peak_active == 4  # and never more than max_batch


def test_an_mla_model_is_batched_with_the_text_it_has_alone(tmp_path):
    """DeepSeek's MLA attention batches too (each sequence's latent in its range of the KV slab): fp32 greedy
    text is the same alone or batched, with the sequences really sharing steps."""
    from _tiny_moe import build_tiny_mla

    path = build_tiny_mla(tmp_path / "tiny-mla")
    kw = dict(memory_budget="2MB", device="cpu", policy="fate-edge", dtype="float32")
    with Engine.load(path, max_batch=1, **kw) as alone, Engine.load(path, max_batch=4, **kw) as batched:
        assert batched.max_batch == 4
        requests = [(p, _cfg(12 + 4 * i)) for i, p in enumerate(PROMPTS[:5])]
        expected = [alone.generate_text(p, c)[0] for p, c in requests]
        assert _interleaved(batched, requests, lead=1) == expected
        stats = batched.batcher.stats
        assert stats.sequences_stepped > 2 * stats.steps and stats.peak_active == 4
        assert stats.active == 0 and stats.kv_reserved_bytes == 0


def test_stop_string_and_a_closed_stream_leave_the_others_untouched(engines):
    alone, batched = engines
    full = alone.generate_text(PROMPTS[0], _cfg(30))[0]
    stop = full[10:13]  # a string the answer reaches part way
    requests = [(PROMPTS[0], _cfg(30, stop=[stop])), (PROMPTS[1], _cfg(30)), (PROMPTS[2], _cfg(30))]
    expected = [alone.generate_text(p, c)[0] for p, c in requests]
    assert expected[0] == full[: full.index(stop)]
    s0, s1, s2 = (batched.stream(p, c) for p, c in requests)
    cancelled = [next(s2).text for _ in range(1)]
    s2.close()  # the reader of the third goes away after one token
    texts = ["".join(x.text for x in s0), "".join(x.text for x in s1)]
    assert texts == expected[:2]
    assert expected[2].startswith("".join(cancelled))
    assert batched.batcher.stats.active == 0 and batched.batcher.stats.kv_reserved_bytes == 0


def test_experts_are_unioned_and_each_read_once_per_layer(bundled_model, bundled_tokenizer):
    calls: list[tuple[int, list[int]]] = []
    base = bundled_model.experts
    assert isinstance(base, InMemoryExpertProvider)

    class Counting(InMemoryExpertProvider):
        def stream(self, layer, expert_ids):
            ids = list(expert_ids)
            calls.append((layer, ids))
            return super().stream(layer, ids)

    routed: dict[int, torch.Tensor] = {}

    def observe(layer, h, idx, weights):
        routed[layer] = idx.clone()

    counting = Counting(base.experts)
    bundled_model.experts, bundled_model.observers = counting, [observe]
    try:
        segs = [Segment(bundled_tokenizer.encode(p)[:1], bundled_model.new_cache()) for p in PROMPTS]
        forward_segments(bundled_model, segs)
    finally:
        bundled_model.experts, bundled_model.observers = base, []
    assert [layer for layer, _ in calls] == sorted(routed)  # one request for experts per MoE layer
    for layer, ids in calls:
        union, counts = routed[layer].flatten().unique(return_counts=True)
        assert sorted(ids) == union.tolist() and len(set(ids)) == len(ids)  # the union, each expert once
        wanted = dict(zip(union.tolist(), counts.tolist()))
        assert [wanted[e] for e in ids] == sorted(wanted.values(), reverse=True)  # most wanted first


def test_kv_caches_are_inside_the_budget():
    per_token = None
    with Engine.load(memory_budget="2MB", device="cpu", max_batch=4, context_tokens=200) as engine:
        per_token = engine.batcher.config.kv_bytes_per_token
        assert engine.batcher.config.kv_budget_bytes == 200 * per_token
        with pytest.raises(BudgetError, match="KV cache"):  # 10 + 300 positions can never fit 200
            engine.stream("def main():", _cfg(300))
        # Two of 130 positions each cannot be held together: the second waits for the first to leave.
        a, b = engine.stream("def f():", _cfg(125)), engine.stream("def g():", _cfg(125))
        ta, tb = "".join(s.text for s in a), "".join(s.text for s in b)
        assert ta and tb and engine.batcher.stats.peak_active == 1
        assert engine.batcher.stats.kv_reserved_bytes == 0


def test_max_batch_defaults():
    with Engine.load(memory_budget="2MB", device="cpu") as engine:
        assert engine.max_batch == 8  # the SDK's engine batches by default (CPU: 8)
    from fate_edge.runtime.engine import Engine as RuntimeEngine

    with RuntimeEngine.load(memory_budget="2MB", device="cpu", max_batch=1) as engine:
        assert engine.batcher is None and engine.max_batch == 1


@pytest.mark.parametrize("gather_max", [256, 0])  # 0: every decode row attends alone over its view of the slab
def test_slab_decode_rows_attend_together_and_match_alone(bundled_model, bundled_tokenizer, gather_max, monkeypatch):
    """Decode rows whose caches share a KV slab take one masked attention per layer; a prompt joining mid-way runs
    in the same step. Greedy tokens equal each sequence's alone, and released ranges are reused."""
    from fate_edge.model import attention
    from fate_edge.model.kv_slab import KVSlab

    monkeypatch.setattr(attention, "GATHER_MAX", gather_max)

    def alone(prompt: str, n: int) -> list[int]:
        cache, out = bundled_model.new_cache(), []
        logits = bundled_model(torch.tensor([bundled_tokenizer.encode(prompt)]), cache, last_only=True)[0, -1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = bundled_model(torch.tensor([[out[-1]]]), cache)[0, -1]
        return out

    slab = KVSlab(bundled_model, 256)
    prompts, n = PROMPTS[:4], 12
    expected = [alone(p, n) for p in prompts]
    segs = [Segment(bundled_tokenizer.encode(p), slab.allocate(64)) for p in prompts[:3]]
    got: list[list[int]] = [[] for _ in prompts]
    logits = forward_segments(bundled_model, segs)
    live = [0, 1, 2]
    for step in range(n + 3):
        for j, row in zip(list(live), logits):
            if len(got[j]) < n:
                got[j].append(int(row.argmax()))
        if step == 2:  # the fourth joins: its prompt in the same step as three decode rows
            live.append(3)
            segs.append(Segment(bundled_tokenizer.encode(prompts[3]), slab.allocate(64)))
        for j, seg in zip(live, segs):
            if got[j] and len(seg.ids) and seg.cache.length > len(bundled_tokenizer.encode(prompts[j])) - 1:
                seg.ids = [got[j][-1]]
        keep = [i for i, j in enumerate(live) if len(got[j]) < n]
        if not keep:
            break
        for i in range(len(live)):
            if i not in keep:
                slab.release(segs[i].cache)
        live, segs = [live[i] for i in keep], [segs[i] for i in keep]
        logits = forward_segments(bundled_model, segs)
    assert got == expected
    assert slab.free_positions == 256 - 64 * len(segs)
    for seg in segs:
        slab.release(seg.cache)
    assert slab.allocate(256) is not None  # released ranges merged back into one


def test_a_decode_batch_is_served_as_decode_and_prefetches_its_union_by_demand():
    """The scheduler treats one row per sequence as decode (not a prompt); the prefetch plan for a batch's predicted
    scores is the union of each sequence's top-k, the experts most sequences want first."""
    from fate_edge.runtime.policy import PRESETS
    from fate_edge.runtime.prefetch_choice import choose

    scores = torch.zeros(4, 16)
    for row, experts in enumerate([(3, 7), (3, 9), (3, 7), (5, 9)]):  # 3: three sequences; 7 and 9: two; 5: one
        scores[row, list(experts)] = torch.tensor([0.9, 0.8])
    picked = [e for e, _, _ in choose(PRESETS["fate-edge"], scores, k=2, width=2)]
    assert picked[0] == 3 and set(picked[1:3]) == {7, 9} and picked[3] == 5

    with Engine.load(memory_budget="2MB", device="cpu", max_batch=2) as engine:
        a, b = engine.stream("def f(x):", _cfg(6)), engine.stream("def g(y):", _cfg(6))  # same length: 2 rows a step
        before = engine.stats.predictions
        assert len(list(a)) == len(list(b)) == 6
        assert engine.batcher.stats.peak_active == 2 and engine.batcher.stats.steps <= 7
        # Predictions are checked in decode steps only: more than a step or two alone (before the second joined)
        # could give, so the two-row steps counted as decode.
        assert engine.stats.predictions - before > 3 * (len(engine.model.config.moe_layers) - 1)


def test_a_request_arriving_mid_way_from_another_thread_joins_the_running_one(monkeypatch):
    """A request read in another thread while one is part way joins its batch (steps of both together), and both
    keep the text they have alone."""
    import threading

    import fate_edge.runtime.batch as batch_module

    first, second = (PROMPTS[1], _cfg(24)), (PROMPTS[3], _cfg(16))
    kw = dict(memory_budget="2MB", device="cpu", policy="fate-edge", dtype="float32")
    with Engine.load(max_batch=1, **kw) as alone:
        expected = [alone.generate_text(p, c)[0] for p, c in (first, second)]
    with Engine.load(max_batch=4, **kw) as batched:
        sizes, real = [], batch_module.forward_segments

        def recording(model, segments):
            sizes.append(len(segments))
            return real(model, segments)

        monkeypatch.setattr(batch_module, "forward_segments", recording)
        a = batched.stream(*first)
        head = [next(a).text for _ in range(4)]
        b = batched.stream(*second)  # queued now, while the first is part way
        out: dict[str, str] = {}
        reader = threading.Thread(target=lambda: out.update(b="".join(s.text for s in b)))
        reader.start()
        rest = "".join(s.text for s in a)
        reader.join(timeout=120)
        assert ["".join(head) + rest, out.get("b")] == expected
        assert 2 in sizes and sizes[0] == 1  # alone at first, then the two together
        stats = batched.batcher.stats
        assert stats.peak_active == 2 and stats.active == 0 and stats.kv_reserved_bytes == 0


def test_a_prompt_scored_before_any_request_leaves_the_slab_usable():
    """The daemon's first request may be an echo with logprobs (lm-eval's loglikelihood): scoring it makes the KV slab
    under inference mode; the batcher must still release ranges of it afterwards (it stopped with a RuntimeError)."""
    from fate_edge.apps.server.logprobs import score_prompt

    with Engine.load(None, max_batch=2, memory_budget="2MB", device="cpu", dtype="float32") as eng:
        ids = eng.tokenizer.encode("def add(a, b):\n    return a + b")
        assert len(score_prompt(eng, ids, 1)) == len(ids)
        with ThreadPoolExecutor(1) as pool:  # a stopped batcher left its reader waiting: bounded here
            text, last = pool.submit(eng.generate_text, ids, _cfg(3)).result(timeout=60)
            assert last.generation_tokens == 3
            assert pool.submit(eng.generate_text, ids, _cfg(3)).result(timeout=60)[0] == text  # still serving


def test_a_request_waiting_behind_a_starved_sequence_is_admitted_when_it_ends(monkeypatch):
    """A sequence whose KV range cannot grow waits while others step, then ends at its length when it is the last;
    the request queued behind the full batch must then join. The starved flag outlived the batch, and the worker
    spun with that request waiting forever."""
    import fate_edge.runtime.batch as batch_module

    real = batch_module.Batcher._room_for
    seen: list[int] = []

    def starved_after_three(self, seq):
        if seq.prompt_ids == first_ids and len(seq.out.history) - len(seq.prompt_ids) >= 3:
            seen.append(1)
            return False  # its range cannot grow any more
        return real(self, seq)

    monkeypatch.setattr(batch_module.Batcher, "_room_for", starved_after_three)
    with Engine.load(None, max_batch=2, memory_budget="2MB", device="cpu", dtype="float32") as eng:
        first_ids = eng.tokenizer.encode(PROMPTS[0])
        a = eng.stream(first_ids, _cfg(20))
        c = eng.stream(PROMPTS[2], _cfg(8))
        heads = [next(a), next(c)]  # both run: the batch is full
        b = eng.stream(PROMPTS[1], _cfg(4))  # waits for a place
        pool = ThreadPoolExecutor(3)  # not waited for on the way out: a hung reader fails the test, not the suite
        try:
            runs = [pool.submit(lambda s=s: list(s)) for s in (a, c, b)]
            ends = [r.result(timeout=60) for r in runs]
        finally:
            pool.shutdown(wait=False)
        assert seen and (ends[0] or heads[:1])[-1].finish_reason == "length"
        assert ends[2][-1].generation_tokens == 4  # admitted once the starved one ended


def test_scoring_runs_on_the_batchers_thread_and_call_returns_or_raises_there():
    """A batched engine computes on one thread only (libgomp cuts every team's spin-waits once the process holds more
    OpenMP helpers than CPUs): a prompt's scoring runs there too, through Batcher.call, whose result or error comes
    back to the caller; a closed engine refuses a call."""
    from fate_edge.apps.server.logprobs import score_prompt

    with Engine.load(None, max_batch=2, memory_budget="2MB", device="cpu", dtype="float32") as eng:
        batcher = eng.batcher
        ran_on: list[str] = []
        real = eng.model._forward  # what the model's call runs

        def recording(*args, **kwargs):
            ran_on.append(threading.current_thread().name)
            return real(*args, **kwargs)

        eng.model._forward = recording
        ids = eng.tokenizer.encode("def add(a, b):\n    return a + b")
        scored = score_prompt(eng, ids, 1)
        assert len(scored) == len(ids) and scored[0] is None and scored[1].logprob <= 0
        assert ran_on and set(ran_on) == {"fate-edge-batch"}
        assert batcher.call(lambda: threading.current_thread().name) == "fate-edge-batch"

        def fail():
            raise ValueError("a bad pass")

        with pytest.raises(ValueError, match="a bad pass"):
            batcher.call(fail)
        assert eng.generate_text(ids, _cfg(3))[1].generation_tokens == 3  # the batch goes on after a failed call
    with pytest.raises(EngineClosedError):
        batcher.call(lambda: None)
