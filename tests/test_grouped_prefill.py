"""Grouped prefill (fate_edge/model/grouped_prefill.py, quant/triton_moe_grouped.py) under Triton's interpreter on
the CPU: the kernels against dequantize-then-matmul at small shapes, and a prompt's logits against the eager
prefill on the bundled model and a Qwen-style checkpoint with a shared expert.

The eager prefill computes an int4 expert on torch's kernel, which holds its scales and takes its input in bf16; the
grouped kernels compute the store's codes and fp16 scales in float32. So the grouped logits are checked against the
store's experts dequantized in float32 (fp32's bar, 1e-4) and are as far from the eager prefill's as those are."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install fate-edge[test])")

from _interpreted import run_child  # noqa: E402
from _tiny_moe import build_tiny_moe  # noqa: E402
from fate_edge.quant.linear import QuantizedLinear  # noqa: E402
from fate_edge.quant.triton_moe import Int4MoELayout  # noqa: E402
from fate_edge.quant.triton_moe_grouped import expert_tiles  # noqa: E402

from fate_edge.format.convert import ConvertOptions, convert  # noqa: E402
from fate_edge.format.store import ExpertStore  # noqa: E402

_KERNEL_DEF = """
def kernel(args):
    from fate_edge.quant.triton_moe_grouped import moe_prefill_int4
    return moe_prefill_int4(**args)
"""

_PREFILL_DEF = """
def prefill(store, ids, tests_dir):
    from fate_edge import load_model
    from fate_edge.runtime.grouped_prefill import use_grouped_prefill
    from fate_edge_lab.bench.sidebyside import resident_int4
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from _dequantized_store import dequantized

    with torch.inference_mode():
        exact = load_model(store, experts=dequantized(store))
        want = exact(ids, exact.new_cache())
        model = load_model(store, experts=resident_int4(store))
        eager = model(ids, model.new_cache())
        grouped = use_grouped_prefill(model, store)
        got = model(ids, model.new_cache())
    assert grouped.calls == len(model.config.moe_layers), grouped.calls
    return eager, got, want
"""

_KERNEL = (
    "import sys, torch\n"
    + _KERNEL_DEF
    + "torch.save(kernel(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])\n"
)

# Every interpreted case the selected tests ask for, in one child: the kernel at the default threads as before,
# then each prefill on one thread. An interpreter (torch, Triton, fate-edge: ~2.5 s) instead of one per case.
_ALL = (
    "import sys, torch\n"
    + _KERNEL_DEF
    + _PREFILL_DEF
    + """
jobs = torch.load(sys.argv[1], weights_only=False)
results = {"kernel": kernel(jobs["kernel"])} if "kernel" in jobs else {}
torch.set_num_threads(1)
for name, (store, ids) in jobs["prefill"].items():
    results[name] = prefill(store, torch.load(ids), sys.argv[2])
torch.save(results, sys.argv[3])
"""
)


def _portable(src, out):
    convert(src, out, ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False)
    return out


@pytest.fixture(scope="module")
def bundled_store(tmp_path_factory, bundled_dir):
    return _portable(bundled_dir, tmp_path_factory.mktemp("grouped") / "bundled")


@pytest.fixture(scope="module")
def qwen_store(tmp_path_factory):
    """A Qwen-style checkpoint (8 experts top-4, a gated shared expert) in the portable layout; only read."""
    d = tmp_path_factory.mktemp("grouped-qwen")
    return _portable(build_tiny_moe(d / "qwen", top_k=4, expert_dim=32), d / "qwen-store")


def _store(which: str, bundled_store, qwen_store):
    """(store, vocabulary to draw a prompt from) of a parametrized case."""
    return (bundled_store, 4000) if which == "bundled" else (qwen_store, 256)


def _expert(store: ExpertStore, layer: int, e: int):
    prec = store.precisions[4]
    ref = store.ref(layer, e, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
    dt = {"codes": torch.uint8, "scale": getattr(torch, prec.scale_dtype), "zero": getattr(torch, prec.scale_dtype)}
    t = {p.name: blob[p.offset : p.offset + p.nbytes].view(dt[p.name.split(".")[1]]).view(p.shape) for p in prec.parts}
    mats = [
        QuantizedLinear.from_packed(t[f"{m}.codes"], t[f"{m}.scale"], t.get(f"{m}.zero"), prec.spec, "cpu", "dequant")
        for m in ("gate", "up", "down")
    ]
    return blob, mats


def test_expert_tiles_cover_each_experts_rows_once():
    experts = torch.tensor([0, 0, 0, 2, 5, 5, 5, 5, 5])  # expert 0: 3 rows, 2: 1, 5: 5; the rest none
    e, a, b = expert_tiles(experts, 6, block_m=2)
    assert e.numel() == 9 // 2 + 6
    tiles = [(int(x), int(y), int(z)) for x, y, z in zip(e, a, b) if y < z]
    assert tiles == [(0, 0, 2), (0, 2, 3), (2, 3, 4), (5, 4, 6), (5, 6, 8), (5, 8, 9)]


def _kernel_case(bundled_store, device: str = "cpu"):
    """A layer's 16 experts in a slab in the cache's order, 21 rows top-2 with one expert on 18 of them (two tiles)
    and most on none or one → (the call's arguments, the experts' dequantized matrices)."""
    store = ExpertStore(bundled_store)
    layout = Int4MoELayout.of(store.precisions[4])
    layer, n_exp, n, k = 2, 16, 21, 2
    slab = torch.zeros(n_exp + 3, layout.slot_bytes, dtype=torch.uint8)
    slot_of = torch.randperm(n_exp + 3, generator=torch.Generator().manual_seed(0))[:n_exp]
    experts = [_expert(store, layer, e) for e in range(n_exp)]
    for e, (blob, _) in enumerate(experts):
        slab[slot_of[e], : blob.numel()] = blob
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, layout.hidden, generator=g)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(n)])
    idx[:18, 0] = 9
    w = torch.softmax(torch.randn(n, k, generator=g), 1)
    args = {"h": h, "idx": idx, "weights": w, "slab": slab, "slot_of": slot_of}
    return {name: t.to(device) for name, t in args.items()} | {"layout": layout, "block_i": 32}, experts


def _check_kernel_outputs(args, experts, ys, ws, tol: float) -> None:
    h, idx, w = (args[name].cpu() for name in ("h", "idx", "weights"))
    assert ys.shape == (*idx.shape, h.shape[1]) and ys.dtype == torch.float32
    for row in range(idx.shape[0]):
        for j, e in enumerate(sorted(idx[row].tolist())):  # expert-id order, each with its own weight
            gate, up, down = experts[e][1]
            want = down(torch.nn.functional.silu(gate(h[row : row + 1])) * up(h[row : row + 1]))[0]
            torch.testing.assert_close(ys[row, j].cpu(), want, rtol=tol, atol=tol)
            assert ws[row, j].cpu() == w[row, idx[row].tolist().index(e)]


PREFILL_CASES = ["bundled", "qwen-shared-expert"]


@pytest.fixture(scope="module")
def interpreted(request, tmp_path_factory, bundled_store, qwen_store):
    """The kernel call and the prompts' prefills that the selected tests below check, run under Triton's
    interpreter in one child → ({case: what the child computed}, the kernel case's expert matrices)."""
    wanted = {
        (item.originalname, getattr(item, "callspec", None) and item.callspec.params.get("which"))
        for item in request.session.items
        if item.module is request.module
    }
    d = tmp_path_factory.mktemp("interpreted")
    jobs: dict = {"prefill": {}}
    experts = None
    if ("test_the_grouped_kernels_match_the_reference", None) in wanted:
        jobs["kernel"], experts = _kernel_case(bundled_store)
    for which in PREFILL_CASES:
        if ("test_grouped_prefill_gives_the_eager_prefills_logits", which) in wanted:
            store, vocab = _store(which, bundled_store, qwen_store)
            torch.save(torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3)), d / f"{which}.pt")
            jobs["prefill"][which] = (str(store), str(d / f"{which}.pt"))
    torch.save(jobs, d / "jobs.pt")
    results = run_child(_ALL, d, d / "jobs.pt", os.path.dirname(__file__))
    return results, jobs, experts


@pytest.mark.slow
def test_the_grouped_kernels_match_the_reference(interpreted):
    results, jobs, experts = interpreted
    ys, ws = results["kernel"]
    _check_kernel_outputs(jobs["kernel"], experts, ys, ws, 1e-5)


@pytest.mark.gpu
def test_the_grouped_kernels_compiled_for_the_gpu_match_the_reference(bundled_store, tmp_path):
    """The same launches compiled for CUDA (scripts/gpu_check.sh runs it where a GPU is lent); tl.dot in IEEE
    float32."""
    args, experts = _kernel_case(bundled_store, "cuda")
    ys, ws = run_child(_KERNEL, tmp_path, *_save(tmp_path, args), interpret=False)
    _check_kernel_outputs(args, experts, ys, ws, 1e-4)


def _save(tmp_path, args) -> list:
    torch.save(args, tmp_path / "args.pt")
    return [tmp_path / "args.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("which", PREFILL_CASES)
def test_grouped_prefill_gives_the_eager_prefills_logits(which, interpreted):
    eager, got, exact = interpreted[0][which]
    assert eager.shape == got.shape == exact.shape == (1, 24, eager.shape[-1])
    # the grouped kernels compute the store's experts in float32: the exact int4 model to fp32's bar
    assert (got - exact).abs().max().item() <= 1e-4
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    # the eager prefill rounds scales and inputs to bf16 (torch's kernel; 4.1e-2 from the exact model on the bundled
    # one, 2.1e-2 on the Qwen-style one): the grouped prefill is as far from it as the exact model is
    eager_off = (eager - exact).abs().max().item()
    assert 0 < eager_off < 0.1 and abs((got - eager).abs().max().item() - eager_off) <= 1e-4
    if which == "bundled":  # a trained model's clear choices: the same greedy token at every position
        assert torch.equal(got.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("which", PREFILL_CASES)
def test_without_triton_the_torch_layer_gives_the_eager_prefill_bit_for_bit(which, bundled_store, qwen_store):
    """No Triton for the slab's device (a CPU, no interpreter): each expert dequantized from its slot, run on its
    rows, summed in k passes, as the eager prefill does; on a model whose experts are those dequantized experts
    the logits are the eager prefill's to the bit."""
    from fate_edge import load_model
    from fate_edge.model.experts import InMemoryExpertProvider, QuantizedExpert
    from fate_edge.runtime.grouped_prefill import use_grouped_prefill

    store, vocab = _store(which, bundled_store, qwen_store)
    s = ExpertStore(store)
    experts = {
        (layer, e): QuantizedExpert(*_expert(s, layer, e)[1])
        for layer in s.index["moe_layers"]
        for e in range(s.index["num_experts"])
    }
    model = load_model(store, experts=InMemoryExpertProvider(experts))
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(ids, model.new_cache())
        grouped = use_grouped_prefill(model, store)
        assert not grouped.triton
        got = model(ids, model.new_cache())
    assert grouped.calls == len(model.config.moe_layers) and torch.equal(got, want)
    with pytest.raises(ValueError, match="grouped prefill is for resident experts"):
        from fate_edge.runtime.engine import Engine
        from fate_edge.runtime.engine_config import EngineConfig

        with Engine(EngineConfig(store, "2MB", "lru")) as eng:
            use_grouped_prefill(eng.model, store)


def test_a_store_in_another_layout_is_refused_with_the_fix(bundled_dir):
    from fate_edge.apps.engine_args import resolve_store
    from fate_edge.runtime.grouped_prefill import load_grouped_prefill

    with pytest.raises(ValueError, match="portable blobs of 4-bit codes.*--layout portable"):
        load_grouped_prefill(resolve_store(bundled_dir, progress=False))  # the default store: torch's CPU layout
