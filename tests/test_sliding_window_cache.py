"""Sliding-window layers keep only their window (``kv_cache.LayerCache`` ``window``): on gpt-oss (windows alternating
with full attention) a conversation far past the window costs the window's bytes on those layers, not the whole
length, and its logits stay transformers' (fp32 within 1e-4), alone, batched, chunked, undone and restored from the
prompt cache. The memory account and the batcher count those layers at their ring, not per token."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _parity import batched_with_a_joiner, one_quiet_thread  # noqa: E402
from test_parity import max_diff  # noqa: E402
from test_parity_gpt_oss import build  # noqa: E402

from fate_edge.model.kv_cache import WINDOW_REACH, LayerCache, window_positions  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

FP32_ATOL = 1e-4
WINDOW = 5
RING = window_positions(WINDOW)  # positions a window layer holds at most
PROMPT_LEN = 12
STEPS = 3 * RING  # decode steps: the ring slides several times


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_quiet_thread():
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The gpt-oss checkpoint, our greedy decode far past the ring, and transformers' logits at every position of
    that same sequence (one teacher-forced forward: its sliding layers mask what ours no longer hold)."""
    hf, path = build(tmp_path_factory.mktemp("gpt_oss_window") / "hf", max_position_embeddings=256)
    model = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7)).tolist()[0]
    cache = model.new_cache()
    steps = [model(torch.tensor([prompt]), cache, last_only=True)[0, -1]]
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(steps[-1].argmax()))
        steps.append(model(torch.tensor([[tokens[-1]]]), cache)[0, -1])
    sequence = prompt + tokens
    with torch.no_grad():
        theirs = hf(torch.tensor([sequence])).logits[0]
    return dict(hf=hf, path=path, model=model, cache=cache, prompt=prompt, sequence=sequence, steps=steps, ref=theirs)


def test_decode_far_past_the_window_matches_transformers(built):
    """Every decode step's logits (the ring slid several times) are transformers' on the whole sequence, and each
    greedy token is transformers' pick at its position."""
    ref, steps = built["ref"], built["steps"]
    assert len(built["sequence"]) > 2 * RING
    for i, ours in enumerate(steps):
        pos = PROMPT_LEN - 1 + i
        assert max_diff(ours, ref[pos]) <= FP32_ATOL, f"position {pos}"
        if pos + 1 < len(built["sequence"]):
            assert built["sequence"][pos + 1] == int(ref[pos].argmax())


def test_window_layers_stop_growing_past_their_ring(built):
    """The sliding layers hold at most the ring's positions whatever the length; the full layer holds them all."""
    model, cache = built["model"], built["cache"]
    cfg = model.config
    assert cfg.sliding_window_layers == (0, 2)
    n = len(built["sequence"])  # every token fed back
    assert cache.length == n
    one = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # one position of one layer, fp32
    for i, lay in enumerate(cache.layers):
        assert isinstance(lay, LayerCache)
        size = sum(b.numel() * b.element_size() for b in lay.buffers)
        if i in cfg.sliding_window_layers:
            assert lay.window == WINDOW and lay.first > 0 and size == RING * one < n * one
            assert WINDOW <= lay.held <= RING
        else:
            assert lay.window is None and lay.first == 0 and size >= n * one
    # the bytes stay put as decoding goes on
    before = [sum(b.numel() for b in cache.layers[i].buffers) for i in cfg.sliding_window_layers]
    for tok in (3, 4, 5, 6, 7, 8, 9, 10) * 4:
        model(torch.tensor([[tok]]), cache)
    assert [sum(b.numel() for b in cache.layers[i].buffers) for i in cfg.sliding_window_layers] == before


def test_a_long_prompt_whole_and_in_chunks_matches_transformers(built):
    """A prompt longer than the ring in one forward, and in chunks of every size against it, attends as
    transformers does: each chunk's queries over the kept end joined to its own keys."""
    model, seq, ref = built["model"], built["sequence"], built["ref"]
    prompt = seq[: 2 * RING + 7]
    whole = model(torch.tensor([prompt]), model.new_cache())[0]
    assert max_diff(whole, ref[: len(prompt)]) <= FP32_ATOL
    for chunk in (1, 3, RING - 1, RING + 2):
        cache, outs = model.new_cache(), []
        for a in range(0, len(prompt), chunk):
            outs.append(model(torch.tensor([prompt[a : a + chunk]]), cache)[0])
        assert max_diff(torch.cat(outs), ref[: len(prompt)]) <= FP32_ATOL, f"chunks of {chunk}"


def test_an_undone_chunk_that_slid_the_ring_runs_again_the_same(built):
    """An undone step (the batcher's retry after a failed read) brings a sliding layer back to its buffers before the
    step, though the step's slide dropped positions: run again, the logits are transformers'."""
    model, seq, ref = built["model"], built["sequence"], built["ref"]
    cache = model.new_cache()
    model(torch.tensor([seq[:20]]), cache)
    saved = cache.snapshot()
    model(torch.tensor([seq[20 : 20 + RING]]), cache)  # slides every window layer
    assert all(lay.first > 0 for lay in cache.layers[::2])
    cache.restore(saved)
    assert cache.length == 20
    again = model(torch.tensor([seq[20 : 20 + RING]]), cache)[0]
    assert max_diff(again, ref[20 : 20 + RING]) <= FP32_ATOL


def test_a_cut_the_window_cannot_go_on_from_is_refused(built):
    model, seq = built["model"], built["sequence"]
    cache = model.new_cache()
    model(torch.tensor([seq[: 2 * RING]]), cache)
    with pytest.raises(ValueError, match="sliding-window layer holding positions .* cannot be cut to 3"):
        cache.truncate(3)
    assert cache.length == 2 * RING  # nothing cut
    cache.truncate(2 * RING - 2)  # within what the ring holds: allowed, and goes on right
    out = model(torch.tensor([seq[2 * RING - 2 : 2 * RING + 3]]), cache)[0]
    assert max_diff(out, built["ref"][2 * RING - 2 : 2 * RING + 3]) <= FP32_ATOL


def test_batched_decode_far_past_the_window_gives_each_sequence_transformers_logits(built):
    """Three sequences on a KV slab (the window layers' rings each sequence's own, outside it), one joining beside
    the others' decode tokens, decoding past the ring: every step's logits are transformers' on that sequence."""
    from fate_edge.model.kv_slab import KVSlab

    model, hf = built["model"], built["hf"]
    seq = built["sequence"]
    prompts, n = [seq[:PROMPT_LEN], seq[3:9], seq[20 : 20 + RING + 4]], RING + 10
    slab = KVSlab(model, 3 * 128)
    assert [i for i, b in enumerate(slab.buffers) if not b] == [0, 2]  # the window layers are not in the slab
    got, segs = batched_with_a_joiner(model, slab, prompts, n, 128)
    for j, (p, ours) in enumerate(zip(prompts, got)):
        tokens = [int(r.argmax()) for r in ours[:-1]]
        with torch.no_grad():
            theirs = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1 :]
        assert len(ours) == n + 1
        assert max(max_diff(a, b) for a, b in zip(ours, theirs)) <= FP32_ATOL, f"sequence {j}"
        assert all(lay.held <= RING for lay in segs[j].cache.layers[::2])


def test_the_prompt_cache_restores_a_window_layers_end(built):
    """A kept long sequence's window layers keep only their end: a next turn sharing it (short of RERUN tokens)
    starts from it with transformers' logits; a prompt sharing only a prefix whose window is gone does not."""
    from fate_edge.runtime.prompt_cache import RERUN, PromptCache

    model, seq, ref = built["model"], built["sequence"], built["ref"]
    kept = seq[: 3 * RING]
    cache = model.new_cache()
    model(torch.tensor([kept]), cache)
    pc = PromptCache(10**8, model.config.num_hidden_layers)
    assert pc.keep(cache, kept)
    (entry,) = pc._entries.values()
    assert entry.layers[0].first > 0 and entry.layers[1].first == 0 and not entry.every_prefix
    assert [s.tensors[0].shape[2] for s in entry.layers] == [
        WINDOW - 1 + WINDOW_REACH,
        len(kept),
        WINDOW - 1 + WINDOW_REACH,
    ]
    # the same tokens again: all but the last RERUN reused, the window before them restored
    for prompt in (kept, seq[: 3 * RING + 9]):
        fresh = model.new_cache()
        n = pc.restore(fresh, prompt)
        assert n == min(len(prompt) - RERUN, len(kept))
        out = model(torch.tensor([prompt[n:]]), fresh)[0]
        assert max_diff(out, ref[n : len(prompt)]) <= FP32_ATOL
    # sharing only the first 10 tokens: the kept window layers hold nothing that far back; not reused
    other = seq[:10] + [(t + 1) % 128 for t in seq[10:30]]
    assert pc.restore(model.new_cache(), other) == 0


def test_the_account_counts_window_layers_at_their_ring(built):
    """kv_bytes_per_token counts the full layer alone; the window layers' rings are a fixed size per sequence
    (state_bytes); where the context is shorter than the ring, they count per token as before."""
    from fate_edge.runtime.memory_account import kv_bytes_per_token, kv_shape, state_bytes

    cfg = built["model"].config
    one = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert kv_bytes_per_token(cfg, torch.float32) == one  # layer 1, the full one
    assert state_bytes(cfg, torch.float32) == 2 * RING * one
    assert kv_shape(cfg, torch.float32, 4096) == (one, 2 * RING * one)
    short = RING - 1
    assert kv_bytes_per_token(cfg, torch.float32, short) == 3 * one and state_bytes(cfg, torch.float32, short) == 0
    # what one sequence really holds past its ring: the account's figure for its length
    cache = built["model"].new_cache()
    built["model"](torch.tensor([built["sequence"][:100]]), cache)
    assert cache.nbytes == 100 * kv_bytes_per_token(cfg, torch.float32) + state_bytes(cfg, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_decode_is_the_whole_cache_decode_to_the_bit(built, dtype, monkeypatch):
    """Decode past several slides reads exactly the keys a cache holding every position does (the window's last
    positions, contiguous and in order: no wrapped ring reaches a kernel), so the logits are the same bits; in bf16
    every step goes through fate-edge's decode attention kernel where it runs here."""
    from fate_edge.model import decode_attention
    from fate_edge.model.kv_cache import KVCache

    calls: list[int] = []
    real = decode_attention.attend
    monkeypatch.setattr(
        decode_attention, "attend", lambda q, k, *a, **kw: calls.append(k.shape[2]) or real(q, k, *a, **kw)
    )
    model = load_model(built["path"], dtype=dtype)
    seq = built["sequence"]
    ring, whole = model.new_cache(), KVCache(model.config.num_hidden_layers)  # whole: every position kept
    assert ring.layers[0].window == WINDOW and whole.layers[0].window is None
    outs = []
    for cache in (ring, whole):
        steps = [model(torch.tensor([seq[:PROMPT_LEN]]), cache, last_only=True)[0, -1]]
        steps += [model(torch.tensor([[tok]]), cache)[0, -1] for tok in seq[PROMPT_LEN:]]
        outs.append(torch.stack(steps))
    assert ring.layers[0].first > 2 * RING  # slid several times
    assert torch.equal(outs[0], outs[1])
    if dtype == torch.bfloat16 and decode_attention.available()[0]:
        assert calls and max(calls) == len(seq)  # the full layer reads every key; the window layers ...
        assert min(calls) == WINDOW  # ... their window, read in place


def test_early_attention_reads_a_window_layers_end(built):
    """The early-attention predictor input for a sliding-window layer past its ring reads the positions the layer
    holds (its end), the same as over a cache holding every position."""
    from fate_edge.predictors.early_attention import EarlyInput

    from fate_edge.model.kv_cache import KVCache

    model, seq = built["model"], built["sequence"]
    ring, whole = model.new_cache(), KVCache(model.config.num_hidden_layers)
    for cache in (ring, whole):
        model(torch.tensor([seq[:100]]), cache)
    assert ring.layers[2].first > 0
    early = EarlyInput(model)
    r = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    outs = []
    try:
        for cache in (ring, whole):
            model.active_cache, model.residual = cache, r
            outs.append(early.estimate(1, r))  # layer 1's next MoE layer: 2, a window layer
    finally:
        model.active_cache, model.residual = None, None
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


def test_a_model_of_window_layers_only_admits_what_the_budget_holds(tmp_path):
    """Every layer a sliding window (Mixtral's ``sliding_window``): nothing grows per token, so the batch's budget
    (one sequence's rings) admits one sequence at a time, each answering its alone text."""
    import shutil

    from _tiny_recurrent import ASSET

    from fate_edge import Engine, GenerateConfig

    config = transformers.MixtralConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / name, tmp_path / name)
    kw = dict(memory_budget="2MB", device="cpu", policy="fate-edge", dtype="float32", context_tokens=128)
    g = GenerateConfig(max_tokens=RING, ignore_eos=True)  # answers past the ring
    prompts = ["def main():\n", "import os\n", "x = [1, 2, 3]\n"]
    with Engine.load(tmp_path, max_batch=1, **kw) as alone:
        expected = [alone.generate_text(p, g)[0] for p in prompts]
    with Engine.load(tmp_path, max_batch=3, **kw) as batched:
        c = batched.batcher.config
        assert c.kv_bytes_per_token == 0 and c.state_bytes == 2 * RING * 2 * 2 * 16 * 4 == c.kv_budget_bytes
        streams = [batched.stream(p, g) for p in prompts]
        texts = ["".join(step.text for step in s) for s in streams]
        assert texts == expected
        assert batched.batcher.stats.peak_active == 1
