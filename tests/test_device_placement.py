"""Every tensor a forward pass makes is made on the model's device (guards for the CUDA path that run without a GPU).

Under ``with torch.device("meta")`` every tensor created without an explicit device becomes a meta tensor: a
decode path that builds ids, rope tables, a rotation, unpack shifts or sampler state without ``device=`` then
computes garbage or fails, so its tokens change. On the CUDA path those same sites were the "Expected all tensors
to be on the same device" errors at the first token.
"""

from types import SimpleNamespace

import pytest
import torch
from fate_edge.predictors.cross_layer_gate import CrossLayerGate
from fate_edge.predictors.learned import LearnedPredictor
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import QuantizedLinear

from fate_edge import GenerateConfig, load_model
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import generate_from_model
from fate_edge.runtime.sampling import SamplingParams

PROMPT = "def parse(argv):\n    "


@pytest.fixture(scope="module")
def kernel_layout_store(tmp_path_factory, bundled_dir):
    """The bundled model converted with torch's CPU int4 layout (what `convert` writes by default on a host
    without AVX512-VNNI) and an int2 cold copy."""
    out = tmp_path_factory.mktemp("placement") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2, layout="cpu-int4"), progress=False)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_generation_makes_nothing_off_the_model_device(bundled_dir, bundled_tokenizer, dtype):
    model = load_model(bundled_dir, dtype=dtype)
    cfg = GenerateConfig(max_tokens=10, ignore_eos=True)
    want = generate_from_model(model, bundled_tokenizer, PROMPT, cfg)[0]
    fresh = load_model(bundled_dir, dtype=dtype)  # its fused weights and tables are built under the meta device
    with torch.device("meta"):
        got = generate_from_model(fresh, bundled_tokenizer, PROMPT, cfg)[0]
    assert got == want


def test_sampling_makes_nothing_off_the_model_device(bundled_dir, bundled_tokenizer):
    model = load_model(bundled_dir)
    cfg = GenerateConfig(
        max_tokens=10,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=3),
    )
    want = generate_from_model(model, bundled_tokenizer, PROMPT, cfg)[0]
    with torch.device("meta"):
        got = generate_from_model(model, bundled_tokenizer, PROMPT, cfg)[0]
    assert got == want


@pytest.mark.parametrize("policy", ["fate-edge", "fate", "activation-path", "load-on-demand-int4"])
def test_engine_makes_nothing_off_the_model_device(kernel_layout_store, policy):
    cfg = GenerateConfig(max_tokens=6, ignore_eos=True)
    with Engine(EngineConfig(kernel_layout_store, "2MB", policy, dtype="bfloat16")) as engine:
        want = engine.generate_text(PROMPT, cfg)[0]
    with Engine(EngineConfig(kernel_layout_store, "2MB", policy, dtype="bfloat16")) as engine, torch.device("meta"):
        got = engine.generate_text(PROMPT, cfg)[0]
    assert got == want


def test_learned_predictor_moves_to_the_model_device(bundled_model):
    learned = LearnedPredictor.from_gate(CrossLayerGate.from_model(bundled_model), kind="lowrank", rank=4)
    learned.attach(SimpleNamespace(device=torch.device("meta")))
    params = [p for m in learned.models.values() for p in m.parameters()]
    assert params and all(p.device.type == "meta" for p in params)


def test_cpu_kernel_layout_decodes_for_another_kernel(kernel_layout_store):
    """A store in torch's CPU layout is re-packed for another device's kernel at load (the CUDA path takes the
    codes through the same unpacking); its dequantized weights compute what the CPU kernel computes."""
    store = ExpertStore(kernel_layout_store)
    prec = store.precisions[4]
    assert prec.layout == "cpu-int4"
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    for layer, expert in [(0, 0), (3, 7), (7, 15)]:
        ref = store.ref(layer, expert, 4)
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
        cpu = decode_expert(blob, prec, torch.float32)
        other = [
            QuantizedLinear.from_cpu_kernel_layout(m.packed, m.scale_zero, prec.spec, "cpu", kernel="dequant")
            for m in (cpu.gate, cpu.up, cpu.down)
        ]
        for fast, slow in zip((cpu.gate, cpu.up, cpu.down), other):
            assert slow.kernel == "dequant"
            xin = x if fast.shape[1] == 192 else x[:, :128]
            a, b = fast(xin), slow(xin)
            assert (a - b).abs().max() <= 2e-2 * a.abs().max()  # tinygemm takes x in bf16; the rest is exact


def test_cpu_kernel_layout_round_trips_the_codes():
    spec = QuantSpec(4, 64)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    q = quantize(w, spec)
    kernel = QuantizedLinear.from_quantized(q, spec, "cpu", kernel="torch-int4")
    back = QuantizedLinear.from_cpu_kernel_layout(kernel.packed, kernel.scale_zero, spec, "cpu", kernel="dequant")
    assert torch.equal(back.q.codes, q.codes)  # int4 codes sit in the 4-bit slot unshifted
    a, b = back(w[:2]), QuantizedLinear.from_quantized(q, spec, "cpu", kernel="dequant")(w[:2])
    assert (a - b).norm() / b.norm() < 1e-2  # scale and zero' travelled in bf16
