"""gpt-oss through the expert store and the CLI: expert biases carried by every precision's blobs (float32 beside
bf16 or int4 matrices), the clamped SwiGLU recorded in the store, and ``fate-edge run`` generating transformers'
greedy text."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_moe import VOCAB, build_tokenizer  # noqa: E402
from test_parity import max_diff  # noqa: E402
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


def test_the_store_records_the_clamp_and_holds_the_biases_exactly(stored):
    path, store = stored
    index = json.loads((store / "store.json").read_text())
    assert index["swiglu_limit"] == 1.0 and index["swiglu_alpha"] == 1.702
    memory = load_model(path)
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
