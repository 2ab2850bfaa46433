"""gpt-oss through the expert store and the CLI: expert biases carried by every precision's blobs (float32 beside
bf16 or int4 matrices), the clamped SwiGLU recorded in the store, and ``fate-edge run`` generating transformers'
greedy text."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _parity import max_diff  # noqa: E402
from _tiny_moe import VOCAB, build_tokenizer  # noqa: E402
from test_parity_gpt_oss import build  # noqa: E402

from fate_edge.apps.cli import main  # noqa: E402
from fate_edge.format.convert import ConvertOptions, convert  # noqa: E402
from fate_edge.format.store import ExpertStore, decode_expert  # noqa: E402
from fate_edge.model.experts import ExpertWeights, InMemoryExpertProvider, QuantizedExpert  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

PROMPT = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1234))
WIDE = dict(hidden_size=128, intermediate_size=128)  # whole int4 groups


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_store")
    _, path = build(root / "hf", **WIDE)
    store = convert(path, root / "store", ConvertOptions.full(bits=4, keep_bf16=True), progress=False)
    return path, store


@pytest.mark.slow  # the int4 + bf16 store of a 128-wide model: ~30 s on a loaded 2-core host
def test_the_store_records_the_clamp_and_holds_the_biases_exactly(stored):
    path, store = stored
    index = json.loads((store / "store.json").read_text())
    assert index["swiglu_limit"] == 1.0 and index["swiglu_alpha"] == 1.702
    memory = load_model(path)
    from fate_edge.format.inspect_model import summarize

    cfg = memory.config  # inspect counts the biases the blobs hold
    assert summarize(store).expert_params == cfg.expert_params * cfg.num_experts * len(cfg.moe_layers)
    opened = ExpertStore(store)
    for bits in (16, 4):
        precision = opened.precisions[bits]
        assert precision.glu.limit == 1.0
        for layer, e in ((0, 3), (2, 7)):
            ref = opened.ref(layer, e, bits)
            with open(ref.path, "rb") as f:
                f.seek(ref.offset)
                expert = decode_expert(memoryview(bytearray(f.read(ref.length))), precision, torch.float32)
            want = memory.experts.get(layer, e)
            assert isinstance(want, ExpertWeights) and want.bias is not None and expert.bias is not None
            assert isinstance(expert, ExpertWeights if bits == 16 else QuantizedExpert)
            assert torch.equal(expert.bias.gate_up, want.bias.gate_up)  # float32 whatever the matrices' precision
            assert torch.equal(expert.bias.down, want.bias.down)
            assert expert.glu == want.glu


@pytest.mark.slow  # the int4 + bf16 store of a 128-wide model: ~30 s on a loaded 2-core host
def test_a_bf16_store_streams_the_checkpoint_with_its_matrices_rounded(stored):
    """Streamed from the store at bits 16: the logits of the checkpoint whose expert matrices are rounded to bf16
    (biases, clamp and everything else as they are)."""
    path, store = stored
    rounded = load_model(path)
    for key, e in rounded.experts.experts.items():
        assert isinstance(e, ExpertWeights) and e.gate_up is not None
        rounded.experts.experts[key] = ExpertWeights.fused(
            e.gate_up.bfloat16().float(), e.down.bfloat16().float(), e.bias, e.glu
        )
    streamed = load_model(store, bits=16)
    assert max_diff(streamed(PROMPT, streamed.new_cache()), rounded(PROMPT, rounded.new_cache())) <= 1e-5


@pytest.mark.slow  # the int4 + bf16 store of a 128-wide model: ~30 s on a loaded 2-core host
def test_int4_experts_streamed_equal_them_resident(stored):
    """The int4 store's experts streamed through the fetch engine, and the same blobs decoded and held resident,
    give the same logits; the biases are what moves them from the checkpoint's (not the rounding alone)."""
    path, store = stored
    streamed = load_model(store, bits=4)
    opened = ExpertStore(store)
    experts = {}
    for ref in (r for r in opened.refs.values() if r.bits == 4):
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            blob = memoryview(bytearray(f.read(ref.length)))
        experts[(ref.layer, ref.expert)] = decode_expert(blob, opened.precisions[4], torch.float32)
    resident = load_model(store, experts=InMemoryExpertProvider(experts))
    ours = streamed(PROMPT, streamed.new_cache())
    assert max_diff(ours, resident(PROMPT, resident.new_cache())) <= 1e-5
    exact = load_model(path)
    assert max_diff(ours, exact(PROMPT, exact.new_cache())) < 1.0  # int4 rounding, not a different model
    for e in experts.values():
        e.bias = None
    unbiased = load_model(store, experts=InMemoryExpertProvider(experts))
    assert max_diff(ours, unbiased(PROMPT, unbiased.new_cache())) > 1e-2


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    hf, path = build(tmp_path_factory.mktemp("gpt_oss_cli") / "hf", vocab_size=VOCAB)
    build_tokenizer(path)
    return hf, path


def test_cli_run_generates_transformers_greedy_text(with_tokenizer, capsys):
    from tokenizers import Tokenizer

    hf, path = with_tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = "def add(a, b):\n    return"
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = tok.decode(out[0, ids.shape[1] :].tolist())
    assert want.strip()
    args = ["run", "--model", str(path), "--experts", "memory", "--dtype", "float32", "--temperature", "0"]
    assert main([*args, "--max-tokens", "12", "--ignore-eos", prompt]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want.rstrip("\n")


@pytest.fixture(scope="module")
def llama_cpp_clamp(tmp_path_factory):
    """llama.cpp computes gpt-oss's SwiGLU at limit 7.0 and alpha 1.702 (constants, not in the GGUF): a checkpoint
    with those."""
    _, path = build(tmp_path_factory.mktemp("gpt_oss_gguf") / "hf", vocab_size=VOCAB, swiglu_limit=7.0)
    build_tokenizer(path)
    return path


@pytest.mark.slow  # two converts and four loads each
@pytest.mark.parametrize("experts", ["F32", "Q8_0", "MXFP4"])
def test_a_gguf_converts_to_the_store_of_its_checkpoint(llama_cpp_clamp, tmp_path, experts):
    """The GGUF llama.cpp writes of the checkpoint: F32 experts give the checkpoint's own store (bf16 and int4
    precisions equal, biases included); q8_0 experts go in with their own codes, at most their rounding away;
    MXFP4 blocks (the published gpt-oss experts) are dequantized as the gguf package does (not kept exact at int4
    yet: that is the MXFP4 expert format's work)."""
    from _gguf_gpt_oss import write_gpt_oss_gguf

    from fate_edge.format.gguf_convert import convert_gguf

    path = llama_cpp_clamp
    gguf = write_gpt_oss_gguf(path, tmp_path / "m.gguf", experts)
    bits = 8 if experts == "Q8_0" else 4
    if experts == "MXFP4":  # dequantized as the gguf package does; fp4 times a power of two is exact in bf16
        import numpy as np
        from gguf import GGMLQuantizationType, quants

        store = convert_gguf(gguf, tmp_path / "mxfp4", ConvertOptions.full(bits=4, keep_bf16=True), progress=False)
        ours, want = load_model(store, bits=16), load_model(path)

        def fp4(w: torch.Tensor) -> torch.Tensor:
            q = quants.quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.MXFP4)
            return torch.from_numpy(quants.dequantize(q, GGMLQuantizationType.MXFP4).copy())

        for key, e in want.experts.experts.items():
            assert isinstance(e, ExpertWeights)
            gate_up = torch.cat([fp4(e.gate), fp4(e.up)])
            want.experts.experts[key] = ExpertWeights.fused(gate_up, fp4(e.down), e.bias, e.glu)
        assert max_diff(ours(PROMPT, ours.new_cache()), want(PROMPT, want.new_cache())) <= 1e-4
        return
    opts = ConvertOptions.full(bits=bits, group_size=32, keep_bf16=True, layout="portable")
    from_gguf = convert_gguf(gguf, tmp_path / "from-gguf", opts, progress=False)
    from_hf = convert(path, tmp_path / "from-hf", opts, progress=False)
    cfg = load_model(from_gguf).config
    assert cfg.model_type == "gpt_oss" and cfg.sliding_window_layers == (0, 2) and cfg.rope.truncate is False
    for b in (16, bits):
        ours, theirs = load_model(from_gguf, bits=b), load_model(from_hf, bits=b)
        diff = max_diff(ours(PROMPT, ours.new_cache()), theirs(PROMPT, theirs.new_cache()))
        # F32 experts: the same store but for rms_norm_eps, which GGUF holds in float32; q8_0: ggml's rounding
        assert diff <= (1e-4 if experts == "F32" else 5e-2), f"bits {b}: {diff:.3g}"


def test_sinks_and_fused_experts_are_float_weights(with_tokenizer):
    """A checkpoint's sinks and fused expert tensors are weights in the model's dtype (not a store's quantized
    codes): a bf16 model holds bf16 sinks, and inspect counts every expert parameter, biases included."""
    from fate_edge.format.inspect_model import summarize

    _, path = with_tokenizer
    model = load_model(path, dtype=torch.bfloat16)
    assert model.w["model.layers.0.self_attn.sinks"].dtype == torch.bfloat16
    cfg = model.config
    assert summarize(path).expert_params == cfg.expert_params * cfg.num_experts * len(cfg.moe_layers)


def test_the_cross_layer_gate_reads_the_router_and_its_bias(with_tokenizer):
    """Fate's predictor applies the next layer's router, named ``mlp.router`` with a bias in gpt-oss, to this
    layer's gate input: its scores are that router's softmax, bias included."""
    import torch.nn.functional as F
    from fate_edge.predictors import CrossLayerGate

    _, path = with_tokenizer
    model = load_model(path)
    gate = CrossLayerGate.from_model(model)
    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pred = gate.predict(0, h)
    lp = model.plan()[1]
    want = F.linear(h, lp.router, lp.router_bias).softmax(-1)
    assert pred.layers == (1,) and max_diff(pred.for_layer(1), want) <= 1e-6


def test_cli_runs_it_through_the_engine_under_a_budget(with_tokenizer, capsys):
    """The default run: converted to a store on demand, experts streamed under a budget, prefetched by the
    cross-layer gate."""
    _, path = with_tokenizer
    assert (
        main(["run", "--model", str(path), "--memory-budget", "1MB", "--max-tokens", "6", "--ignore-eos", "def"]) == 0
    )
    out, err = capsys.readouterr()
    assert out.strip() and "6 generated" in err and "hit rate" in err
