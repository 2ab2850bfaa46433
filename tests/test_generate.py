import pytest

from fate_edge import GenerateConfig, GenerationError, SamplingParams, stream_from_model
from fate_edge.runtime.generate import generate_from_model

PROMPT = "def parse_args(argv):\n    "


def test_greedy_is_deterministic_and_streams(bundled_model, bundled_tokenizer):
    cfg = GenerateConfig(max_tokens=24, ignore_eos=True)
    steps = list(stream_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg))
    assert len(steps) == 24
    assert [s.generation_tokens for s in steps] == list(range(1, 25))
    assert steps[-1].finish_reason == "length" and all(s.finish_reason is None for s in steps[:-1])
    text = "".join(s.text for s in steps)
    assert text == bundled_tokenizer.decode([s.token for s in steps])
    again, _ = generate_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg)
    assert again == text
    assert steps[-1].peak_rss_bytes > 0 and steps[-1].prompt_tps > 0


def test_seeded_sampling_is_reproducible(bundled_model, bundled_tokenizer):
    def run(seed):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.1, seed=seed)
        return generate_from_model(
            bundled_model, bundled_tokenizer, PROMPT, GenerateConfig(20, params, ignore_eos=True)
        )[0]

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c  # a different seed takes a different path on a trained model at temperature 1


def test_stop_string_ends_generation_before_it(bundled_model, bundled_tokenizer):
    cfg = GenerateConfig(max_tokens=40, ignore_eos=True)
    full, _ = generate_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg)
    stop = full[5:8]  # a string the model is known to produce
    cut, last = generate_from_model(
        bundled_model, bundled_tokenizer, PROMPT, GenerateConfig(40, stop=[stop], ignore_eos=True)
    )
    assert last.finish_reason == "stop"
    assert cut == full[: full.index(stop)]
    assert stop not in cut


def test_stop_token_ends_generation(bundled_model, bundled_tokenizer):
    cfg = GenerateConfig(max_tokens=30, ignore_eos=True)
    steps = list(stream_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg))
    target = steps[3].token
    cfg2 = GenerateConfig(max_tokens=30, stop_token_ids=[target], ignore_eos=True)
    steps2 = list(stream_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg2))
    first = next(i for i, s in enumerate(steps) if s.token == target)
    assert len(steps2) == first + 1 and steps2[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(top_k=-3), "top_k"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
    ],
)
def test_bad_sampling_parameters_are_named(bundled_model, bundled_tokenizer, params, match):
    with pytest.raises(GenerationError, match=match):
        generate_from_model(bundled_model, bundled_tokenizer, PROMPT, GenerateConfig(4, params))


def test_prompt_longer_than_context_is_refused(bundled_model, bundled_tokenizer):
    ids = [5] * bundled_model.config.max_position_embeddings
    with pytest.raises(GenerationError, match="context"):
        generate_from_model(bundled_model, bundled_tokenizer, ids, GenerateConfig(4))


def test_empty_prompt_is_refused(bundled_model, bundled_tokenizer):
    with pytest.raises(GenerationError, match="empty"):
        generate_from_model(bundled_model, bundled_tokenizer, "", GenerateConfig(4))


def test_decode_loop_reads_peak_rss_every_32_tokens_and_at_the_end(bundled_model, bundled_tokenizer, monkeypatch):
    import sys

    gen = sys.modules["fate_edge.runtime.generate"]  # the package exports a function of the same name
    reads = []
    monkeypatch.setattr(gen, "peak_rss_bytes", lambda: reads.append(1) or len(reads))
    steps = list(stream_from_model(bundled_model, bundled_tokenizer, PROMPT, GenerateConfig(70, ignore_eos=True)))
    assert len(steps) == 70
    assert len(reads) == 1 + 2 + 1  # after prefill, at tokens 32 and 64, and for the final response
    assert steps[-1].peak_rss_bytes == len(reads)  # the last response carries a fresh read
    assert steps[40].peak_rss_bytes == 2  # in between: the latest read


def test_greedy_sampling_takes_the_argmax_without_copying_the_logits(monkeypatch):
    import torch

    from fate_edge.runtime.sampling import Sampler

    logits = torch.randn(1000)
    clones = []
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: clones.append(1))
    assert Sampler(SamplingParams())(logits, [1, 2]) == int(logits.argmax()) and clones == []
