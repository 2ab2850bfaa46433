"""The Triton int4 MoE kernel (quant/triton_moe.py) under Triton's interpreter on the CPU, against the reference:
each expert dequantized and computed in float32, summed in expert-id order (layer_step.add_routed). It reads the
store's portable blobs in place, from a slab of slots in the order the cache put them."""

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install fate-edge[test])")

from fate_edge.quant.linear import QuantizedLinear  # noqa: E402
from fate_edge.quant.triton_moe import Int4MoELayout  # noqa: E402

from fate_edge.format.convert import ConvertOptions, convert  # noqa: E402
from fate_edge.format.store import ExpertStore, Precision, decode_expert, encode_expert, plan_parts  # noqa: E402
from fate_edge.model.experts import ExpertWeights  # noqa: E402
from fate_edge.model.layer_step import add_routed  # noqa: E402

_RUN = """
import sys, torch
from fate_edge.quant.triton_moe import MoEScratch, moe_int4


def run(args):
    first = moe_int4(**args)
    # twice more on kept scratch (as a replayed graph): the counter the last program reset lets the launch run again
    scratch = MoEScratch.for_layout(args["layout"], args["slots"].numel(), args["block_i"], args["x"].device)
    again = [moe_int4(**args, scratch=scratch).clone() for _ in range(2)]
    assert int(scratch.count) == 0 and all(torch.equal(a, first) for a in again)
    return first
"""
_CHILD = _RUN + "torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])\n"
# several launches' arguments in, their outputs out: one interpreter (torch, Triton, fate-edge) for them all
_CHILD_ALL = _RUN + "torch.save([run(a) for a in torch.load(sys.argv[1], weights_only=False)], sys.argv[2])\n"


def _child(tmp_path, script: str, payload, interpret: bool = True):
    """``script`` on ``payload`` under Triton's interpreter (or compiled for the GPU), in a process of its own:
    Triton reads TRITON_INTERPRET when triton.language is imported, which another test (or torch) may have done
    here."""
    torch.save(payload, tmp_path / "args.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (
        {"TRITON_INTERPRET": "1"} if interpret else {}
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


def _interpreted(tmp_path, interpret: bool = True, **args) -> torch.Tensor:
    """``moe_int4(**args)`` (and twice more on kept scratch) in a child of its own."""
    return _child(tmp_path, _CHILD, args, interpret).cpu()


STORES = {"asym-fp16": (4, True, "float16"), "sym-fp32": (4, False, "float32")}


def _make_store(kind: str, tmp_path_factory, bundled_dir):
    bits, asym, scales = STORES[kind]
    out = tmp_path_factory.mktemp("triton") / "s"
    opts = ConvertOptions.full(bits=bits, keep_bf16=False, layout="portable")
    convert(bundled_dir, out, opts, progress=False)
    if asym and scales == "float16":
        return ExpertStore(out)
    # a symmetric spec with fp32 scales (a GGUF's q4_K keeps fp32 ones): the same experts re-encoded so
    s = ExpertStore(out)
    p = s.precisions[4]
    spec = type(p.spec)(4, p.spec.group_size, False)
    parts, nbytes = plan_parts(4, spec, 192, 128, "portable", "float32")
    prec = Precision(4, p.file, nbytes, parts, spec, "portable", "float32")
    return s, prec


@pytest.fixture(scope="module")
def stores(tmp_path_factory, bundled_dir):
    """Each kind of store, built on first use and kept for the module (the tests only read it)."""
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = _make_store(kind, tmp_path_factory, bundled_dir)
        return built[kind]

    return get


@pytest.fixture(scope="module", params=list(STORES))
def store(request, stores):
    return stores(request.param)


def _blobs(store, layer, experts):
    """The experts' blobs as the store holds them (or re-encoded in another precision), and their decodes."""
    if isinstance(store, tuple):
        src, prec = store
        blobs = []
        for e in experts:
            w = decode_expert(_read(src, layer, e), src.precisions[4], torch.float32)
            dense = [_dense(lin) for lin in (w.gate, w.up, w.down)]
            blobs.append(torch.frombuffer(bytearray(encode_expert(ExpertWeights(*dense), prec)), dtype=torch.uint8))
        return blobs, prec
    return [_read(store, layer, e) for e in experts], store.precisions[4]


def _read(store, layer, e):
    ref = store.ref(layer, e, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)


def _dense(lin: QuantizedLinear) -> torch.Tensor:
    return lin(torch.eye(lin.shape[1])).T.contiguous()


def _reference(blobs, prec, weights, x):
    """Each expert dequantized (float32 matmuls), summed in expert-id order as every path sums them."""
    dtypes = {"codes": torch.uint8, "scale": getattr(torch, prec.scale_dtype), "zero": getattr(torch, prec.scale_dtype)}
    acc = None
    for blob, w in zip(blobs, weights.tolist()):
        t = {
            p.name: blob[p.offset : p.offset + p.nbytes].view(dtypes[p.name.split(".")[1]]).view(p.shape)
            for p in prec.parts
        }
        gate, up, down = (
            QuantizedLinear.from_packed(
                t[f"{m}.codes"], t[f"{m}.scale"], t.get(f"{m}.zero"), prec.spec, "cpu", "dequant"
            )
            for m in ("gate", "up", "down")
        )
        y = down(torch.nn.functional.silu(gate(x[None])) * up(x[None]))
        acc = add_routed(acc, y, w)
    return acc[0]


CASES = [(0, [2, 5]), (3, [0, 7, 11, 15])]


def _case(store, layer: int, experts: list[int]):
    """A launch on ``experts`` of ``layer`` from a slab of 6 slots holding them in the cache's order, not the
    experts' order → (their blobs, the precision, moe_int4's arguments)."""
    blobs, prec = _blobs(store, layer, experts)
    layout = Int4MoELayout.of(prec)
    slab = torch.zeros(6, layout.slot_bytes, dtype=torch.uint8)
    slots = torch.tensor([4, 1, 5, 0][: len(experts)])
    for s, blob in zip(slots.tolist(), blobs):
        slab[s, : blob.numel()] = blob
    x = torch.randn(192, generator=torch.Generator().manual_seed(layer))
    w = torch.softmax(torch.randn(len(experts), generator=torch.Generator().manual_seed(7)), 0)
    return blobs, prec, {"x": x, "slab": slab, "slots": slots, "weights": w, "layout": layout, "block_i": 32}


@pytest.fixture(scope="module")
def interpreted(request, stores, tmp_path_factory):
    """Every launch the selected cases below ask for, run under Triton's interpreter in one child (each with its
    two replays on kept scratch, as before) → {(store kind, layer): (blobs, precision, arguments, output)}."""
    test = "test_the_kernel_matches_the_reference_in_expert_id_order"
    wanted = [
        (item.callspec.params["store"], item.callspec.params["layer"], item.callspec.params["experts"])
        for item in request.session.items
        if item.module is request.module and item.originalname == test
    ]
    cases = {(kind, layer): _case(stores(kind), layer, experts) for kind, layer, experts in wanted}
    outputs = _child(tmp_path_factory.mktemp("interpreted"), _CHILD_ALL, [args for _, _, args in cases.values()])
    return {key: (*case, out.cpu()) for (key, case), out in zip(cases.items(), outputs)}


@pytest.mark.parametrize("layer, experts", CASES)
def test_the_kernel_matches_the_reference_in_expert_id_order(store, layer, experts, interpreted, request):
    blobs, prec, args, got = interpreted[(request.node.callspec.params["store"], layer)]
    want = _reference(blobs, prec, args["weights"], args["x"])
    assert got.dtype == torch.float32 and got.shape == (192,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_a_layout_it_does_not_read(tmp_path, bundled_dir):
    out = tmp_path / "cpu"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False, layout="cpu-int4"), progress=False)
    with pytest.raises(ValueError, match="portable blobs of 4-bit codes.*--layout portable"):
        Int4MoELayout.of(ExpertStore(out).precisions[4])


@pytest.mark.gpu
def test_the_kernel_compiled_for_the_gpu_matches_the_reference(store, tmp_path):
    """The same launch compiled for CUDA (scripts/gpu_check.sh runs it where a GPU is lent)."""
    blobs, prec = _blobs(store, 3, [0, 7, 11, 15])
    layout = Int4MoELayout.of(prec)
    slab = torch.zeros(4, layout.slot_bytes, dtype=torch.uint8)
    slots = torch.tensor([2, 0, 3, 1])
    for s, blob in zip(slots.tolist(), blobs):
        slab[s, : blob.numel()] = blob
    x = torch.randn(192, generator=torch.Generator().manual_seed(5))
    w = torch.softmax(torch.randn(4, generator=torch.Generator().manual_seed(6)), 0)
    args = {"x": x.cuda(), "slab": slab.cuda(), "slots": slots.cuda(), "weights": w.cuda()}
    got = _interpreted(tmp_path, interpret=False, **args, layout=layout, block_i=32)
    torch.testing.assert_close(got, _reference(blobs, prec, w, x), rtol=1e-4, atol=1e-4)
