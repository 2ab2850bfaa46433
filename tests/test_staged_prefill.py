"""Grouped prefill at a budget (fate_edge/runtime/staged_prefill.py) on the bundled model's portable int4 store: a
prompt's layers from staged blobs of the experts they route to, read once each, the next layer's reads issued
before a layer computes, the staging charged to the expert budget. Without Triton for the CPU the grouped layer runs
in torch (bit for bit the eager prefill of the store's dequantized experts); under Triton's interpreter the grouped
kernels (slow: a child process, within fp32's 1e-4 of those experts)."""

import os
from collections import Counter

import pytest
import torch
from _dequantized_store import dequantized
from _interpreted import run_child

from fate_edge import load_model
from fate_edge.errors import BudgetError
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.host_tier import HostTier
from fate_edge.runtime.staged_prefill import use_budgeted_grouped_prefill

BUDGET = 3_000_000  # the cache holds 39 of the 128 experts; 18 once the staging (2 layers of 16) is taken


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("staged") / "portable"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False)
    return out


def budgeted_prompts(store, prompts, decode_first: bool = False):
    """Each prompt's logits through the budgeted grouped path of a fresh engine at ``BUDGET`` → (logits, the events
    in order: ("read", layer, expert) per store read submitted, ("computed", layer) per grouped layer, ("routed",
    layer, experts) per prompt layer, ("prompt",) per prompt), the server, the engine's plan before and after)."""
    events: list[tuple] = []
    logits = []
    with Engine(EngineConfig(str(store), BUDGET, "fate-edge", dtype="float32", max_batch=1)) as eng:
        before = (eng.plan.cache_bytes, eng.cache.capacity_bytes)
        server = use_budgeted_grouped_prefill(eng)
        submit = eng.fetch.submit

        def read(ref, *a):
            events.append(("read", ref.layer, ref.expert))
            return submit(ref, *a)

        def routed(layer, h, idx, w):
            if h.shape[0] > 1:
                events.append(("routed", layer, set(idx.flatten().tolist())))

        def computed(layer, *a):
            out = server(layer, *a)
            events.append(("computed", layer))
            return out

        eng.fetch.submit, eng.model.grouped_prefill = read, computed
        eng.model.observers.insert(0, routed)
        with torch.inference_mode():
            for i, ids in enumerate(prompts):
                eng.scheduler.new_sequence()
                events.append(("prompt",))
                cache = eng.model.new_cache()
                logits.append(eng.model(ids, cache))
                if decode_first and i == 0:  # decode tokens: the eager path fills the cache
                    for _ in range(3):
                        eng.model(logits[-1][:, -1:].argmax(-1), cache)
        plan = eng.plan
        after = (plan.cache_bytes, eng.cache.capacity_bytes, plan.prefill_staging_bytes, plan.minimum, plan.budget)
        return logits, events, server, before, after


def test_budgeted_grouped_prefill_reads_each_expert_once_and_the_next_layer_ahead(store):
    prompts = [torch.randint(0, 4000, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 9)]
    with torch.inference_mode():
        exact = load_model(store, experts=dequantized(store))
        want = [exact(ids, exact.new_cache()) for ids in prompts]
    (got, got2), events, server, before, after = budgeted_prompts(store, prompts, decode_first=True)
    assert not server.grouped.triton  # a CPU without the interpreter: the grouped layer in torch
    # each expert dequantized from its staged blob on its rows: the exact model's eager prefill to the bit
    assert torch.equal(got, want[0]) and torch.equal(got2, want[1])
    assert server.calls == 2 * 8  # every MoE layer of both prompts grouped

    # the staging is charged to the budget: taken from the cache's share, never above it
    cache_before, cap_before = before
    cache_after, cap_after, staging, minimum, budget = after
    assert server.nbytes == staging == 2 * 16 * ExpertStore(store).precisions[4].slot_bytes
    assert cap_after + staging <= cap_before and cache_after + staging <= cache_before
    assert minimum + cache_after + staging <= budget
    assert cap_after // 69120 < 128  # the budget holds fewer than all experts (entries of 69,120 bytes)

    prompt_events = [i for i, ev in enumerate(events) if ev[0] == "prompt"]
    first, second = events[: prompt_events[1]], events[prompt_events[1] :]
    # each expert read at most once per prompt (a read ahead the routing did not use included)
    assert max(Counter((ev[1], ev[2]) for ev in second if ev[0] == "read").values()) == 1
    first_prompt = first[: next(i for i, ev in enumerate(first) if ev == ("computed", 7)) + 1]
    reads = Counter((ev[1], ev[2]) for ev in first_prompt if ev[0] == "read")
    needed = {(ev[1], e) for ev in first_prompt if ev[0] == "routed" for e in ev[2]}
    assert max(reads.values()) == 1 and needed <= set(reads)  # nothing cached yet: every needed expert read once
    # reads of a later layer were issued before an earlier layer's grouped compute finished (the predictor's reads
    # ahead, used: prefetch hits), seen in the event order and in the server's count at each compute's start
    done = {ev[1]: i for i, ev in enumerate(first_prompt) if ev[0] == "computed"}
    early = [L for L in range(7) if any(ev[0] == "read" and ev[1] > L for ev in first_prompt[: done[L]])]
    assert early == list(range(7)), early
    assert all(server.ahead.get(L, 0) > 0 for L in range(7))
    # the reads ahead were used, and the decode tokens between the prompts (the eager path) changed nothing above
    assert server.sources["prefetched"] > 0 and server.sources["demand"] > 0


def test_a_budget_that_cannot_stage_a_layer_is_refused_naming_the_budget(store):
    with Engine(EngineConfig(str(store), "1MB", "fate-edge", dtype="float32", max_batch=1)) as eng:
        with pytest.raises(BudgetError, match=r"grouped prefill at a budget stages 2 layers.*raise --memory-budget"):
            use_budgeted_grouped_prefill(eng)
        assert eng.model.grouped_prefill is None and eng.plan.prefill_staging_bytes == 0


def test_blobs_the_host_tier_holds_are_staged_from_it_and_not_read_again(store):
    """A run with a host tier (a discrete GPU's, here on the CPU): the prompt's blobs are admitted there as they are
    read, and the same prompt again is staged from it with no store read, to the same logits."""
    ids = torch.randint(0, 4000, (1, 10), generator=torch.Generator().manual_seed(10))
    reads: list[tuple[int, int]] = []
    with Engine(EngineConfig(str(store), BUDGET, "fate-edge", dtype="float32", max_batch=1)) as eng:
        cfg, slot = eng.model.config, eng.store.precisions[4].slot_bytes
        eng.scheduler.host = HostTier(128 * slot, slot, eng.policy, list(cfg.moe_layers), cfg.num_experts)
        server = use_budgeted_grouped_prefill(eng)
        with pytest.raises(ValueError, match="grouped already"):  # charged once
            use_budgeted_grouped_prefill(eng)
        assert eng.plan.prefill_staging_bytes == server.nbytes
        submit = eng.fetch.submit
        eng.fetch.submit = lambda ref, *a, **kw: (reads.append((ref.layer, ref.expert)), submit(ref, *a, **kw))[1]
        with torch.inference_mode():
            eng.scheduler.new_sequence()
            first = eng.model(ids, eng.model.new_cache())
            read_first, staged = len(reads), sum(server.sources.values())
            eng.scheduler.new_sequence()
            again = eng.model(ids, eng.model.new_cache())
    assert read_first > 0 and len(reads) == read_first  # the second prompt read nothing
    assert server.sources["host"] == sum(server.sources.values()) - staged > 0
    tier = eng.scheduler.host  # the reads landed straight in their slots, each slot valid or free, none left reserved
    assert tier.stats.read_into == len(tier) > 0 and tier.stats.staged == 0
    assert len(tier.cache.entries) == len(tier)  # every slot its policy charges holds a blob
    assert torch.equal(first, again)


def _native_store(tmp_path):
    """A 3-layer Qwen-style checkpoint (8 experts, top-2) whose matrices fate-edge's native int4 kernel takes (K a
    multiple of 128), as a portable store: its cached experts are their read buffers (the CPU's zero-copy cache)."""
    from _tiny_moe import build_tokenizer
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    dims = {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 128}
    cfg = Qwen2MoeConfig(
        vocab_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        **dims,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(cfg).save_pretrained(tmp_path / "src")
    build_tokenizer(tmp_path / "src")
    out = tmp_path / "store"
    convert(tmp_path / "src", out, ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False)
    return out


@pytest.mark.slow  # builds a checkpoint with transformers
def test_experts_the_zero_copy_cache_holds_are_staged_from_their_buffers(tmp_path):
    store = _native_store(tmp_path)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(8))
    reads: list[tuple[int, int]] = []
    with torch.inference_mode():
        exact = load_model(store, experts=dequantized(store))
        want = exact(ids, exact.new_cache())
        with Engine(EngineConfig(str(store), 800_000, "fate-edge", dtype="float32", max_batch=1)) as eng:
            assert eng.scheduler.zero_copy
            server = use_budgeted_grouped_prefill(eng)
            assert eng.cache.capacity_bytes < 24 * eng.cache.entry_bytes  # fewer than the 24 experts
            cache = eng.model.new_cache()
            out = eng.model(ids, cache)
            for _ in range(3):  # decode tokens: the eager path caches experts in their read buffers
                out = eng.model(out[:, -1:].argmax(-1), cache)
            held = set(eng.scheduler._kept)
            submit = eng.fetch.submit
            eng.fetch.submit = lambda ref, *a, **kw: (reads.append((ref.layer, ref.expert)), submit(ref, *a, **kw))[1]
            before = server.sources["cache"]
            eng.scheduler.new_sequence()
            got = eng.model(ids, eng.model.new_cache())
    assert held and server.sources["cache"] > before  # staged from the cached experts' buffers ...
    assert not held & set(reads) and max(Counter(reads).values()) == 1  # ... which were not read again
    assert torch.equal(got, want)


def test_reads_ahead_are_not_made_ready_early_during_a_staged_prompt(store):
    """Where the scheduler uploads reads ahead as they land (a GPU's ``land_early``, set here on the CPU), a staged
    prompt takes their blobs instead: uploaded into the cache they would be read again."""
    ids = torch.randint(0, 4000, (1, 10), generator=torch.Generator().manual_seed(11))
    reads: list[tuple[int, int]] = []
    with Engine(EngineConfig(str(store), BUDGET, "fate-edge", dtype="float32", max_batch=1)) as eng:
        eng.scheduler.land_early = True
        server = use_budgeted_grouped_prefill(eng)
        submit = eng.fetch.submit
        eng.fetch.submit = lambda ref, *a, **kw: (reads.append((ref.layer, ref.expert)), submit(ref, *a, **kw))[1]
        with torch.inference_mode():
            eng.scheduler.new_sequence()
            eng.model(ids, eng.model.new_cache())
        landed = eng.scheduler.stats.landed_early
    assert max(Counter(reads).values()) == 1 and server.sources["prefetched"] > 0 and landed == 0


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_staged_prefill import budgeted_prompts, dequantized
from fate_edge import load_model
torch.set_num_threads(1)
store, ids = sys.argv[2], torch.randint(0, 4000, (1, 6), generator=torch.Generator().manual_seed(6))
with torch.inference_mode():
    exact = load_model(store, experts=dequantized(store))
    want = exact(ids, exact.new_cache())
(got,), events, server, _, after = budgeted_prompts(store, [ids])
assert server.grouped.triton and server.calls == 8, (server.grouped.triton, server.calls)
torch.save((got, want, events, server.nbytes, after), sys.argv[3])
"""


@pytest.mark.slow
def test_budgeted_grouped_kernels_give_the_store_experts_logits(store, tmp_path):
    """The grouped Triton kernels (under the interpreter) on the staged regions: the store's experts dequantized in
    float32, to fp32's bar; each expert read at most once."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install fate-edge[test])")
    got, want, events, nbytes, after = run_child(_INTERPRETED, tmp_path, os.path.dirname(__file__), store)
    assert got.shape == want.shape == (1, 6, want.shape[-1])
    assert (got - want).abs().max().item() <= 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))
    reads = Counter((ev[1], ev[2]) for ev in events if ev[0] == "read")
    needed = {(ev[1], e) for ev in events if ev[0] == "routed" for e in ev[2]}
    assert max(reads.values()) == 1 and needed <= set(reads)
    assert nbytes == after[2]  # the staging the budget was charged
