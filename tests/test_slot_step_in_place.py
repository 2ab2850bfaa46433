"""The slot decode step's in-place opt-in (``SlotGraphDecode(..., in_place=True)``): the scheduler keeps portable
int4 experts as their uploaded blobs (``runtime.portable_expert``), the slots hold those blobs byte for byte, and each
MoE layer of a token is one launch of the Triton int4 MoE kernel reading them in place (``quant.triton_moe``).

On the bundled model's portable store at a budget of about a third of the experts, on the CPU: the blobs and their
charge without Triton (a blob kept is computed as the decoded expert, so the logits are the same bits), and the whole
decode under Triton's interpreter (a child process, slow) against the eager streamed decode of the same store, with
the experts computed in float32 on both sides (the kernel's own precision), to fp32's 1e-4."""

import os

import pytest
import torch
from _interpreted import run_child

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.portable_expert import PortableExpert

BUDGET = "2MB"


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("in_place") / "portable"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False)
    return out


def _stored_blob(eng, key) -> bytes:
    ref = eng.store.ref(*key, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return f.read(ref.length)


def test_kept_blobs_are_the_stored_bytes_charged_as_such_and_compute_as_decoded(store, one_thread):
    ids = torch.randint(0, 4000, (1, 9), generator=torch.Generator().manual_seed(9))
    with Engine(EngineConfig(str(store), BUDGET, "lru", dtype="float32")) as eng, torch.inference_mode():
        want = eng.model(ids, eng.model.new_cache())
    with Engine(EngineConfig(str(store), BUDGET, "lru", dtype="float32")) as eng, torch.inference_mode():
        eng.scheduler.keeps_blobs = True
        got = eng.model(ids, eng.model.new_cache())
        entries = eng.cache.entries
        assert entries and all(isinstance(e.expert, PortableExpert) for e in entries.values())
        for key, entry in entries.items():  # the blob as stored (no re-pack), charged its own bytes
            assert bytes(entry.expert.blob.numpy()) == _stored_blob(eng, key)
            assert entry.nbytes == entry.expert.blob.numel() == eng.store.ref(*key, 4).length
    assert torch.equal(got, want)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import fate_edge.quant.linear as linear
linear.default_kernel = lambda *a, **kw: "dequant"  # the eager side in float32 too: the kernel's own precision
from test_slot_step import decode
from test_slot_step_in_place import BUDGET
from fate_edge.model.slot_step import SlotGraphDecode
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
torch.set_num_threads(1)
store, steps = sys.argv[2], 4
cfg = EngineConfig(store, BUDGET, "lru", dtype="float32")
with Engine(cfg) as eng:
    eager = decode(eng, steps=steps)
with Engine(cfg) as eng:
    step = SlotGraphDecode(eng.model, capture=False, in_place=True)
    got = decode(eng, step, steps=steps)
    cache = eng.model.experts.cache
    slab, table = step.slab["blob"], step.table
    same = all(slab[table.slot(k)].data_ptr() == e.expert.blob.data_ptr() for k, e in cache.entries.items())
    state = dict(failed=step.failed, reruns=step.reruns, eager_tokens=step.eager_tokens, slotted=len(step.table),
                 cached=len(cache.entries), all_in_slots=same, syncs=list(step.syncs_per_token))
torch.save((eager[:2], got[:2], eager[3], got[3], state), sys.argv[3])
"""


@pytest.mark.slow
def test_in_place_slot_step_gives_the_eager_decode_under_the_interpreter(store, tmp_path):
    pytest.importorskip("triton", reason="Triton is not installed (pip install fate-edge[test])")
    results = run_child(_INTERPRETED, tmp_path, os.path.dirname(__file__), store, timeout=600)
    (eager_toks, eager_logits), (toks, logits), eager_counts, counts, state = results
    assert state["failed"] is None and state["eager_tokens"] == 0  # every token through the slots
    assert state["reruns"] > 0 and counts[1] > 0  # misses happened, were read and took slots
    assert state["all_in_slots"] and state["slotted"] == state["cached"] > 0  # each cached blob is its slot
    syncs = state["syncs"]  # one host sync a token, one more for each rerun after a miss
    assert len(syncs) == len(toks) and sum(syncs) == len(syncs) + state["reruns"]
    assert torch.equal(toks, eager_toks)
    assert (logits - eager_logits).abs().max().item() <= 1e-4


@pytest.mark.gpu
def test_the_captured_in_place_slot_step_on_cuda_gives_the_layer_graphs_tokens(store):
    """Captured and replayed (scripts/gpu_check.sh runs it where a GPU is lent): the Triton launch inside the token's
    graph, the blobs copied into their slots on the copy stream; the per-layer graphs' tokens (their experts on
    torch's int4 kernel in bf16, so the logits only close)."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install fate-edge[test])")
    from test_slot_step import decode

    from fate_edge.model.graph_step import LayerGraphDecode
    from fate_edge.model.slot_step import SlotGraphDecode

    with Engine(EngineConfig(str(store), BUDGET, "lru", device="cuda")) as eng:
        want = decode(eng, LayerGraphDecode(eng.model), steps=8)
    with Engine(EngineConfig(str(store), BUDGET, "lru", device="cuda")) as eng:
        step = SlotGraphDecode(eng.model, in_place=True)
        got = decode(eng, step, steps=8)
        assert step.failed is None and step.captures >= 1 and step.eager_tokens == 0
        assert step.copy_stream is not None and step.slab["blob"].dtype == torch.uint8
    assert torch.equal(got[0], want[0])
    assert ((got[1] - want[1]).norm() / want[1].norm()).item() < 1e-2
    assert sum(step.syncs_per_token) == 8 + step.reruns
