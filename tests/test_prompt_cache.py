"""The prompt cache (runtime/prompt_cache.py): a finished request's KV kept by its tokens, a new request prefilling only
past its longest kept prefix, the same greedy text as without it (alone, batched, concurrent; GQA and MLA), inside
its room of the memory account, and a recurrent snapshot reused only at its exact length."""

import pytest
import torch

from fate_edge import Engine, GenerateConfig
from fate_edge.model.kv_cache import AttentionState, Keys, SavedLayer
from fate_edge.runtime.memory_account import kv_bytes_per_token, memory_account
from fate_edge.runtime.prompt_cache import PromptCache, prompt_cache_room

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(memory_budget="2MB", device="cpu", dtype="float32")
FIRST = "def main():\n    print('hello')\n" * 6
TURNS = ["\n# the second turn\nimport os\n", "\nclass Point:\n    def __init__(self, x"]


def _cfg(n: int = 8, **kw) -> GenerateConfig:
    return GenerateConfig(max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module", params=[4, 1], ids=["batched", "alone"])
def engines(request):
    """fp32 engines on the bundled model, int4 experts: the prompt cache on (auto) and off."""
    with (
        Engine.load(None, max_batch=request.param, **KW) as on,
        Engine.load(None, max_batch=request.param, prompt_cache=0, **KW) as off,
    ):
        yield on, off


def _conversation(engine: Engine, config: GenerateConfig) -> tuple[list[str], list[int]]:
    """Three turns, each prompt the last one's prompt and answer plus new text → the answers and prompt lengths."""
    tok = engine.tokenizer
    prompt = tok.encode(FIRST)
    answers, lengths = [], []
    for turn in ["", *TURNS]:
        prompt = prompt + tok.encode(turn) if turn else prompt
        text, _ = engine.generate_text(prompt, config)
        answers.append(text)
        lengths.append(len(prompt))
        prompt = prompt + tok.encode(text)
    return answers, lengths


def test_next_turns_prefill_only_new_tokens_with_the_same_greedy_text(engines):
    on, off = engines
    assert off.prompt_cache is None and on.prompt_cache is not None
    before = on.prompt_cache.stats.tokens_saved
    answers, lengths = _conversation(on, _cfg())
    assert answers == _conversation(off, _cfg())[0]
    s = on.prompt_cache.stats
    # each later turn reused at least the previous prompt (its answer re-encodes as sampled, bar the last token)
    assert s.tokens_saved - before >= lengths[0] + lengths[1]
    assert 0 < s.bytes_held <= on.prompt_cache.room_bytes


@pytest.mark.parametrize("engines", [4], indirect=True, ids=["batched"])
def test_the_batcher_runs_only_the_new_rows(engines):
    on, off = engines
    assert on.batcher is not None
    tok = on.tokenizer
    first = tok.encode(FIRST + "# rows\n")
    text, _ = on.generate_text(first, _cfg(4))
    second = first + tok.encode(text) + tok.encode(TURNS[0])
    rows = on.batcher.stats.rows
    saved = on.prompt_cache.stats.tokens_saved
    assert on.generate_text(second, _cfg(4))[0] == off.generate_text(second, _cfg(4))[0]
    reused = on.prompt_cache.stats.tokens_saved - saved
    assert reused >= len(first)
    assert on.batcher.stats.rows - rows == len(second) - reused + 3  # the new prompt rows, then 3 decode rows


@pytest.mark.parametrize("engines", [4], indirect=True, ids=["batched"])
def test_concurrent_streams_sharing_prefixes_match_the_cache_off_text(engines):
    on, off = engines
    assert on.batcher is not None
    tok = on.tokenizer
    base = tok.encode("import sys\n" * 10)
    on.generate_text(base, _cfg(2))  # kept: every prompt below starts with it
    prompts = [base + tok.encode(t) for t in ["x = 1\n", "def f(a):\n", "for i in range(3):\n", "# done\n"]]
    hits = on.prompt_cache.stats.hits

    def run(engine: Engine) -> list[str]:
        streams = [engine.stream(p, _cfg(6)) for p in prompts]
        texts = [[] for _ in prompts]
        open_ = list(range(len(streams)))
        while open_:  # read round-robin: the requests are in the batch together
            for i in list(open_):
                step = next(streams[i], None)
                if step is None:
                    open_.remove(i)
                else:
                    texts[i].append(step.text)
        return ["".join(t) for t in texts]

    assert run(on) == run(off)
    assert on.prompt_cache.stats.hits - hits == len(prompts)


def test_cache_prompt_false_neither_reuses_nor_keeps(engines):
    on, _ = engines
    tok = on.tokenizer
    prompt = tok.encode("while True:\n    pass\n" * 5)
    st = on.prompt_cache.stats
    kept, hits = st.kept, st.hits
    on.generate_text(prompt, _cfg(2, cache_prompt=False))
    on.generate_text(prompt + tok.encode("x"), _cfg(2, cache_prompt=False))
    assert (st.kept, st.hits) == (kept, hits)


def _prefill(model, ids: list[int], cache) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]), cache, last_only=True)[0, -1]


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    from _tiny_moe import build_tiny_mla

    return build_tiny_mla(tmp_path_factory.mktemp("mla") / "tiny-mla")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_a_restored_prefix_continues_exactly_as_the_kept_cache_would(kind, request):
    """The model's own KVCache (GQA keys and values, or MLA's latent): positions restored from the prompt cache give
    the very logits the original cache gives when it runs the same new tokens, and a prefix of them the logits of
    that prefix computed afresh (fp32 within 1e-4)."""
    from fate_edge.runtime.loader import load_model

    if kind == "gqa":
        model = request.getfixturevalue("bundled_model")
    else:
        model = load_model(request.getfixturevalue("tiny_mla"), dtype=torch.float32)
    ids = [(7 * i + 3) % 200 + 5 for i in range(40)]
    kept = model.new_cache()
    _prefill(model, ids[:30], kept)
    pc = PromptCache(1 << 30, model.config.num_hidden_layers)
    assert pc.keep(kept, ids[:30])
    for n, new in [(30, ids[30:]), (20, [9, 8, 7, 6, 5])]:  # the whole entry, or a prefix of it
        fresh = model.new_cache()
        assert pc.restore(fresh, ids[:n] + new) == n
        reference = model.new_cache()
        _prefill(model, ids[:n], reference)
        reference_logits = _prefill(model, new, reference)
        restored = _prefill(model, new, fresh)
        if n == 30:  # the kept cache itself, continued: the same positions, bit for bit
            assert torch.equal(_prefill(model, new, kept), reference_logits)
            assert torch.equal(restored, reference_logits)
        else:  # positions 0..19 were computed inside a 30-token prefill: the same up to matmul rounding
            torch.testing.assert_close(restored, reference_logits, atol=1e-4, rtol=0)


def test_the_room_is_never_exceeded_lru_evicts_and_a_too_big_entry_keeps_what_fits(bundled_model):
    model = bundled_model
    per = kv_bytes_per_token(model.config, model.dtype)
    pc = PromptCache(25 * per, model.config.num_hidden_layers)
    caches = {}
    for start in (10, 40, 70):
        ids = list(range(start, start + 10))
        caches[start] = model.new_cache()
        _prefill(model, ids, caches[start])
        assert pc.keep(caches[start], ids)
        assert pc.bytes_held <= pc.room_bytes
    assert pc.stats.entries == 2 and pc.stats.evictions == 1  # the first went
    assert pc.restore(model.new_cache(), list(range(10, 20)) + [1, 2]) == 0
    assert pc.restore(model.new_cache(), list(range(40, 50)) + [1, 2]) == 10
    big = list(range(100, 140))
    cache = model.new_cache()
    _prefill(model, big, cache)
    assert pc.keep(cache, big)  # 40 positions in a room of 25: its first 25 kept, everything else evicted
    assert pc.bytes_held == 25 * per and pc.stats.entries == 1
    assert pc.restore(model.new_cache(), big) == 25


class _Recurrent(AttentionState):
    """A state that cannot be cut back (a convolution window or linear-attention state): it saves snapshots."""

    def __init__(self, layers: int):
        self.state = [torch.zeros(1, 4) for _ in range(layers)]
        self.length = 0

    def update(self, layer: int, *new: torch.Tensor) -> Keys:
        self.state[layer] += new[0].sum(0)
        self.length += layer == 0
        return (self.state[layer],)

    def save_layer(self, layer: int, n: int) -> SavedLayer:
        if n != self.length:
            raise ValueError("a snapshot is taken at its length")
        return SavedLayer((self.state[layer].clone(),), n, positional=False)

    def saved_nbytes(self, layer: int, n: int) -> int:
        return self.state[layer].numel() * self.state[layer].element_size()

    def restore_layer(self, layer: int, saved: SavedLayer, n: int) -> None:
        assert saved.usable(n)
        self.state[layer] = saved.tensors[0].clone()
        self.length = n


def test_a_recurrent_snapshot_is_reused_only_at_its_exact_length():
    state = _Recurrent(2)
    for t in range(6):
        for layer in range(2):
            state.update(layer, torch.full((1, 4), float(t)))
    pc = PromptCache(1 << 20, 2)
    assert pc.keep(state, [1, 2, 3, 4, 5, 6])
    exact = _Recurrent(2)
    assert pc.restore(exact, [1, 2, 3, 4, 5, 6, 7, 8]) == 6 and exact.length == 6
    assert torch.equal(exact.state[1], state.state[1])
    assert pc.restore(_Recurrent(2), [1, 2, 3, 4, 9, 9]) == 0  # shares 4: a snapshot cannot be cut back
    assert pc.restore(_Recurrent(2), [1, 2, 3, 4, 5, 6, 7]) == 0  # its last two tokens run again: 5 < 6
    assert not PromptCache(10, 2).keep(state, [1, 2, 3, 4, 5, 6])  # too big for the room, and cannot be cut


def test_the_memory_account_declares_the_room_and_auto_budget_leaves_it(bundled_dir):
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.model.arch import load_config

    bundled_store = ensure_store(bundled_dir, progress=False)
    per = kv_bytes_per_token(load_config(bundled_store), torch.float32)
    none = memory_account(bundled_store, 3_000_000, "float32", 512, runtime=0)
    auto = memory_account(bundled_store, 3_000_000, "float32", 512, runtime=0, prompt_cache="auto")
    assert none.prompt_cache == 0 and auto.prompt_cache == per * 512 == prompt_cache_room("auto", per, 512)
    assert auto.running - none.running == auto.prompt_cache
    assert any(line.strip().startswith("prompt cache") for line in auto.lines())
    assert memory_account(bundled_store, 0, "float32", 512, runtime=0, prompt_cache="1MB").prompt_cache == 1_000_000
    with pytest.raises(ValueError, match="prompt_cache"):
        prompt_cache_room("lots", per, 512)
    with Engine.load(None, max_batch=1, prompt_cache="64KB", **KW) as eng:
        assert eng.prompt_cache is not None and eng.prompt_cache.room_bytes == 64_000
        assert eng.account.prompt_cache == 64_000


def test_the_cli_option_reaches_the_engine_options():
    import argparse

    from fate_edge.apps.engine_args import EngineOptions, add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineOptions.from_args(p.parse_args([])).prompt_cache == "auto"
    assert EngineOptions.from_args(p.parse_args(["--prompt-cache", "0"])).prompt_cache == "0"
    assert EngineOptions.from_args(p.parse_args(["--prompt-cache", "256MB"])).prompt_cache == "256MB"
    with pytest.raises(SystemExit):
        p.parse_args(["--prompt-cache", "lots"])


def test_an_mla_model_through_the_batcher_gives_the_cache_off_text(tiny_mla):
    """MLA's latent cache in the batch's slab: a kept prefix restored there continues as a fresh prefill does."""
    prompt = [(5 * i + 7) % 200 + 3 for i in range(40)]
    kw = dict(memory_budget="64MB", device="cpu", dtype="float32", max_batch=2, context_tokens=256)
    texts = {}
    for room in ("auto", 0):
        with Engine.load(tiny_mla, prompt_cache=room, **kw) as eng:
            first, _ = eng.generate_text(prompt, _cfg(6))
            second = prompt + eng.tokenizer.encode(first) + prompt[:10]
            texts[room] = (first, eng.generate_text(second, _cfg(6))[0])
            if room:
                assert eng.model.config.mla is not None and eng.prompt_cache.stats.tokens_saved >= len(prompt)
    assert texts["auto"] == texts[0]
