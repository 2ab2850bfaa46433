"""fate-edge model-card (fate_edge_lab.bench.model_card) end to end on a tiny random qwen2_moe (a random model predicts
~uniformly), and the training script it documents (scripts/train_tiny_moe.py)."""

import json
import math

import pytest
from _scripts import ROOT, load_script
from _tiny_moe import VOCAB, build_tiny_moe, write_training_log

from fate_edge.corpus import CorpusSplit, read_corpus
from fate_edge_lab.bench import model_card


@pytest.fixture(scope="module")
def card_run(tmp_path_factory):
    model_dir = build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
    write_training_log(model_dir)
    assert (
        model_card.main([str(model_dir), "--tokens", "512", "--seq-len", "64", "--batch", "4", "--threads", "1"]) == 0
    )
    return model_dir, json.loads((model_dir / "model_card.json").read_text())


def test_writes_json_with_measured_numbers(card_run):
    model_dir, card = card_run
    h = card["heldout"]
    assert h["files"] > 0 and h["tokens_available"] >= 512
    assert h["tokens_scored"] == 8 * 63  # 512 tokens = 8 windows of 64, each predicting 63
    assert h["ppl"] == pytest.approx(math.exp(h["loss"]))
    assert VOCAB / 3 < h["ppl"] < VOCAB * 3  # untrained: close to uniform over the vocabulary
    a = card["architecture"]
    assert (a["layers"], a["moe_layers"], a["experts"], a["experts_per_token"]) == (4, 3, 8, 2)
    assert a["params_total"] > a["params_active_per_token"] > a["params_total"] - a["params_routed_experts"]


def test_per_layer_usage_and_prediction_tables(card_run):
    _, card = card_run
    assert [u["layer"] for u in card["usage"]] == [0, 1, 3]  # layer 2 is dense
    for u in card["usage"]:
        assert 0 < u["entropy"] <= 1 and 1 / 8 <= u["top_share"] <= 1
    c = card["cross_layer_gate"]
    assert c["k"] == 2 and c["bytes_per_expert_bf16"] == 3 * 32 * 16 * 2
    assert [(r["source"], r["target"]) for r in c["layers"]] == [(0, 1), (1, 3)]
    for r in c["layers"]:
        assert 0 <= r["exact"] <= r["recall@k"] <= r["recall@k+2"] <= 1
        assert 0 <= r["norm_variant_exact"] <= r["norm_variant_recall@k"] <= 1
        # 4 predicted, at most 2 used: between 2 and 4 experts' bytes are wasted per token.
        assert 2 * c["bytes_per_expert_bf16"] <= r["wasted_bytes_per_token@k+2"] <= 4 * c["bytes_per_expert_bf16"]
    assert [la["distance"] for la in c["lookahead"]] == [1, 2]  # 0→3 is the only distance-2 pair
    assert c["mean"]["recall@k"] == pytest.approx(sum(r["recall@k"] for r in c["layers"]) / 2)


def test_readme_renders_training_and_tables(card_run):
    model_dir, card = card_run
    readme = (model_dir / "README.md").read_text()
    for section in (
        "## Corpus",
        "## Architecture",
        "## Training",
        "## Held-out perplexity",
        "## Expert usage per layer",
        "## Cross-layer gate prediction (Fate)",
    ):
        assert section in readme
    assert f"**{card['heldout']['ppl']:.2f}**" in readme
    assert "200 steps, 819,200 tokens, 5.0 minutes" in readme
    assert "| 200 | 819,200 |" in readme  # last loss-curve row
    assert "| 1 → 3 |" in readme
    assert "Intermediate checkpoint" not in readme
    # Reproduce: the training commands the log records, then this model's calibrate and model-card commands.
    assert "python scripts/train_tiny_moe.py --out tiny --minutes 5\n" in readme
    assert f"fate-edge model-card {model_dir} --tokens {card['heldout']['tokens_scored']}" in readme
    log = json.loads((model_dir / "training_log.json").read_text())
    partial = {"config": log["config"], "complete": False, "log": log["log"][:3]}
    assert "**Intermediate checkpoint**" in model_card.readme_markdown(card, partial)
    assert "No `training_log.json`" in model_card.readme_markdown(card, None)
    assert "does not record the training commands" in model_card.readme_markdown(card, partial)


def test_the_bundled_model_card_is_what_the_command_renders(monkeypatch):
    """The committed README of the bundled model is readme_markdown of its committed model_card.json and
    training_log.json (so regenerating it changes only what was measured again)."""
    monkeypatch.chdir(ROOT)  # the card names its model as refresh_artifacts.sh passes it: fate_edge/assets/tiny-moe
    model_dir = ROOT / "fate_edge" / "assets" / "tiny-moe"
    card = json.loads((model_dir / "model_card.json").read_text())
    readme = model_card.readme_markdown(card, model_card.read_training_log(model_dir))
    assert readme == (model_dir / "README.md").read_text()
    assert "python scripts/train_tiny_moe.py --out fate_edge/assets/tiny-moe" in readme


def test_heldout_split_is_the_training_scripts(card_run):
    tr = load_script("scripts/train_tiny_moe.py")
    cfg = {"heldout_fraction": 0.02, "max_corpus_bytes": 2_000_000, "unknown_key": 1}
    texts = model_card.heldout_texts(cfg)
    assert texts and texts == tr.read_corpus(tr.TrainConfig(heldout_fraction=0.02, max_corpus_bytes=2_000_000))[1]
    train, held = read_corpus(CorpusSplit(0.02, 2_000_000))
    assert held == texts and train and not set(train) & set(held)


def test_training_config_overrides_are_typed_and_checked():
    tr = load_script("scripts/train_tiny_moe.py")
    cfg = tr.config_with(tr.TrainConfig(), ["num_experts=8", "lr=5e-4"])
    assert cfg.num_experts == 8 and isinstance(cfg.num_experts, int) and cfg.lr == 5e-4
    assert cfg.hidden_size == tr.TrainConfig().hidden_size  # the rest stays the bundled model's
    with pytest.raises(SystemExit, match="FIELD one of"):
        tr.config_with(tr.TrainConfig(), ["experts=8"])
    with pytest.raises(SystemExit, match="not a valid int"):
        tr.config_with(tr.TrainConfig(), ["num_experts=eight"])
    with pytest.raises(SystemExit, match="expected qwen2_moe or mixtral"):
        tr.build_model(tr.config_with(tr.TrainConfig(), ["architecture=llama"]), 0)


def test_training_script_builds_a_mixtral_layout_that_fate_edge_runs(tmp_path):
    """--set architecture=mixtral: no shared expert, experts of moe_intermediate_size; the saved model loads in
    fate-edge with the reference's logits (the second trained layout the predictor figures are measured on)."""
    import torch

    from fate_edge.runtime.loader import load_model

    tr = load_script("scripts/train_tiny_moe.py")
    cfg = tr.config_with(
        tr.TrainConfig(),
        [
            "architecture=mixtral",
            "num_experts=4",
            "hidden_size=32",
            "num_hidden_layers=2",
            "moe_intermediate_size=48",
            "vocab_size=64",
        ],
    )
    hf = tr.build_model(cfg, 0).eval()
    assert hf.config.model_type == "mixtral" and hf.config.num_local_experts == 4
    assert hf.config.intermediate_size == 48
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32)
    assert model.config.model_type == "mixtral" and model.config.moe_layers == [0, 1]
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits[0, -1]
    got = model(ids, model.new_cache(), last_only=True).reshape(-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_ceiling_scripts_cross_token_pairs_stay_inside_a_window(tmp_path):
    """--cross-token: row t is paired with row t + 1 of its own window only, and the untrained predictor is the
    first MoE layer's router reading the last one's gate input through the ratio of their norms."""
    import torch
    from fate_edge.predictors.evaluate import Trace
    from fate_edge.predictors.learned import LearnedPredictor

    from fate_edge.model.layer import rms_norm
    from fate_edge.runtime.loader import load_model

    ceiling = load_script("research/predictor_ceiling.py")
    ids = {0: torch.arange(12).view(6, 2), 3: 100 + torch.arange(12).view(6, 2)}  # two windows of 3 positions
    trace = Trace({3: torch.arange(6.0)[:, None].expand(6, 4)}, ids, 16)
    src, dst = ceiling.next_token_pairs(trace, 3)
    assert src.tolist() == [0, 1, 3, 4] and dst.tolist() == [1, 2, 4, 5]
    pair = ceiling.cross_token_trace(trace, 3, first=0, last=3)
    assert pair.gate_inputs[0][:, 0].tolist() == [0, 1, 3, 4]  # the last layer's input at token t
    assert torch.equal(pair.expert_ids[1], ids[0][[1, 2, 4, 5]])  # the first layer's experts at t + 1

    model = load_model(build_tiny_moe(tmp_path / "tiny"), torch.float32)
    cfg, names = model.config, model.names
    first, last = cfg.moe_layers[0], cfg.moe_layers[-1]
    x = torch.randn(5, cfg.hidden_size)
    h_last = rms_norm(x, model.w[f"{names[last].post_attn_norm}.weight"], cfg.rms_norm_eps)
    h_first = rms_norm(x, model.w[f"{names[first].post_attn_norm}.weight"], cfg.rms_norm_eps)
    untrained = LearnedPredictor.from_gate(ceiling.cross_token_gate(model), "lowrank", 8)
    # Where the residual is the same, the rescaled last input is the first layer's own gate input: its routing.
    torch.testing.assert_close(
        untrained.predict(0, h_last).scores[0].topk(cfg.num_experts_per_tok).indices,
        model.route(first, h_first)[1],
        atol=0,
        rtol=0,
    )


def test_the_ceiling_scripts_own_router_is_exact_on_the_residual_its_norm_reads(tmp_path):
    """--routers-only: each layer's router on the residual its post-attention norm reads (after the attention)
    must reproduce the forward's routing exactly; on the input before the attention it may not."""
    import torch
    from fate_edge.predictors.evaluate import collect_traces
    from transformers import AutoModelForCausalLM

    from fate_edge.runtime.loader import load_model

    ceiling = load_script("research/predictor_ceiling.py")
    path = build_tiny_moe(tmp_path / "tiny")
    model = load_model(path, torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    held = collect_traces(model, [ids])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    after_attention: dict[int, list[torch.Tensor]] = {j: [] for j in model.config.moe_layers}
    hooks = [
        hf.model.layers[j].post_attention_layernorm.register_forward_pre_hook(
            lambda _m, args, j=j: after_attention[j].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for j in model.config.moe_layers
    ]
    with torch.no_grad():
        hf(input_ids=ids)
    for h in hooks:
        h.remove()
    exact = ceiling.own_router_rows(model, held, {j: torch.cat(v) for j, v in after_attention.items()})
    own = exact["layer j's router on its input before its attention"]
    assert sorted(own) == model.config.moe_layers
    assert all(s == {"exact": 1.0, "recall": 1.0} for s in own.values())
    cross = exact["cross-layer gate (norm-aware) on the previous MoE layer's gate input"]
    assert sorted(cross) == model.config.moe_layers[1:]  # nothing before the first MoE layer routes
    before = ceiling.own_router_rows(model, held, ceiling.pre_attention_inputs(hf, ids, model.config.moe_layers, 2))
    assert any(s["recall"] < 1.0 for s in before["layer j's router on its input before its attention"].values())
