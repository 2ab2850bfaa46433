"""Long prompts in chunks (bounded activations) and a KV cache allocated once for the request's whole length."""

import torch

from fate_edge import GenerateConfig
from fate_edge.apps.engine_args import resolve_store
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import generate_from_model, prompt_chunks


def _prompt(model, n: int) -> list[int]:
    return torch.randint(5, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_prompt_chunks_cover_the_prompt_in_ranges_of_two_or_more():
    for n in range(1, 80):
        for chunk in (0, 1, 2, 3, 7, 16, 512):
            ranges = prompt_chunks(n, chunk)
            assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
            assert n == 1 or min(b - a for a, b in ranges) >= 2  # a one-token forward would be a decode step
            assert chunk == 0 or max(b - a for a, b in ranges) <= max(chunk, 3)
    assert prompt_chunks(1025, 512) == [(0, 512), (512, 1023), (1023, 1025)]


def test_chunked_prefill_gives_the_whole_prompt_tokens(bundled_model, bundled_tokenizer):
    ids = _prompt(bundled_model, 300)
    runs = {
        c: generate_from_model(
            bundled_model, bundled_tokenizer, ids, GenerateConfig(max_tokens=12, ignore_eos=True, prefill_chunk=c)
        )[0]
        for c in (0, 64, 97)
    }
    assert runs[64] == runs[0] and runs[97] == runs[0]


def test_chunked_prefill_gives_the_whole_prompt_logits(bundled_model):
    ids = torch.tensor([_prompt(bundled_model, 200)])
    whole = bundled_model(ids, bundled_model.new_cache(), last_only=True)
    cache = bundled_model.new_cache()
    for a, b in prompt_chunks(200, 48):
        part = bundled_model(ids[:, a:b], cache, last_only=True)
    assert cache.length == 200
    assert ((part - whole).norm() / whole.norm()).item() < 1e-5  # fp32: rounding only


def test_engine_serves_a_chunked_prompt(bundled_dir):
    store = resolve_store(bundled_dir, progress=False)
    with Engine(EngineConfig(store, "2MB", "lru")) as engine:
        ids = _prompt(engine.model, 180)
        whole = engine.generate_text(ids, GenerateConfig(max_tokens=10, ignore_eos=True, prefill_chunk=0))[0]
        chunked = engine.generate_text(ids, GenerateConfig(max_tokens=10, ignore_eos=True, prefill_chunk=50))[0]
    assert chunked == whole


def test_the_kv_cache_is_allocated_once_for_prompt_and_answer(bundled_model, bundled_tokenizer, monkeypatch):
    caches = []
    real = bundled_model.new_cache
    monkeypatch.setattr(bundled_model, "new_cache", lambda: caches.append(real()) or caches[-1])
    ids = _prompt(bundled_model, 300)
    generate_from_model(
        bundled_model, bundled_tokenizer, ids, GenerateConfig(max_tokens=40, ignore_eos=True, prefill_chunk=128)
    )
    [cache] = caches
    assert cache.length == 339  # the last sampled token is not fed back
    assert {b.shape[2] for lay in cache.layers for b in lay.buffers} == {340}  # never doubled to 600
