"""Grammar mask cost per token against a decode step on the bundled model: llguidance vs xgrammar.

The runtime masks the logits of every token of a structured answer (runtime.structured); the issue's target is a mask
cost under 10% of a decode step. This script:

1. samples answers under each JSON schema with llguidance-constrained decoding on the bundled model (the token
   sequences both libraries then replay, so both mask the same steps);
2. in interleaved rounds, times (a) a decode step of the engine (one token of ``engine.stream``, no grammar), (b)
   llguidance's per-token work as the runtime does it (mask, apply to the logits, advance: ``GrammarMask``) and (c)
   xgrammar's (``fill_next_token_bitmask``, ``apply_token_bitmask_inplace``, ``accept_token``);
3. prints medians per round and overall, the ratios, each library's compile time per schema, the CPU and load average.

xgrammar is optional (``pip install xgrammar``; it is not a fate-edge dependency):

    python research/grammar_mask_cost.py --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.sampling import SamplingParams
from fate_edge.runtime.structured import JSON_OPTIONS, GrammarMask, json_schema_grammar

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "op": {"enum": ["add", "sub", "mul"]},
            "args": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 24}]},
        },
        "required": ["op", "args", "note"],
        "additionalProperties": False,
    },
    "free_strings": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}, "body": {"type": "string", "maxLength": 60}},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        return platform.processor() or "?"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sample_sequences(engine: Engine, answers: int) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for name, schema in SCHEMAS.items():
        grammar = json_schema_grammar(schema)
        out[name] = []
        for seed in range(answers):
            cfg = GenerateConfig(max_tokens=160, sampling=SamplingParams(temperature=0.9, seed=seed), grammar=grammar)
            tokens = [s.token for s in engine.stream("def main():", cfg) if s.token is not None]
            out[name].append(tokens)
    return out


def decode_steps(engine: Engine, tokens: int) -> list[float]:
    stamps = []
    for _ in engine.stream("def main():\n", GenerateConfig(max_tokens=tokens + 1, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # the first step follows the prefill


def llguidance_steps(engine: Engine, seqs: dict[str, list[list[int]]], vocab: int) -> list[float]:
    times = []
    logits = torch.randn(vocab)
    for name, answers in seqs.items():
        grammar = json_schema_grammar(SCHEMAS[name])
        for tokens in answers:
            mask = GrammarMask(engine.tokenizer, grammar)
            for t in tokens:
                t0 = time.perf_counter()
                mask.apply(logits)
                mask.consume(t)
                times.append(time.perf_counter() - t0)
    return times


class XGrammar:
    def __init__(self, engine: Engine, vocab: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer._tok)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab, stop_token_ids=sorted(engine.tokenizer.eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab = vocab

    def compile(self, schema: dict):
        seps = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=seps)

    def steps(self, seqs: dict[str, list[list[int]]]) -> tuple[list[float], int]:
        xgr, times, refused = self.xgr, [], 0
        compiled = {name: self.compile(SCHEMAS[name]) for name in seqs}
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)
        for name, answers in seqs.items():
            for tokens in answers:
                matcher = xgr.GrammarMatcher(compiled[name])
                for t in tokens:
                    logits = torch.randn(1, self.vocab)  # outside the timing, as the llguidance side's input
                    t0 = time.perf_counter()
                    matcher.fill_next_token_bitmask(bitmask)
                    xgr.apply_token_bitmask_inplace(logits, bitmask)
                    ok = matcher.accept_token(t)
                    times.append(time.perf_counter() - t0)
                    if not ok:
                        refused += 1
                        break
        return times, refused


def compile_ms(fn, schemas) -> dict[str, float]:
    out = {}
    for name, schema in schemas.items():
        t0 = time.perf_counter()
        fn(schema)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--answers", type=int, default=6, help="sampled answers per schema")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with Engine.load(memory_budget="2MB", device="cpu", max_batch=1) as engine:
        vocab = engine.model.config.vocab_size
        seqs = sample_sequences(engine, args.answers)
        n_tokens = sum(len(t) for a in seqs.values() for t in a)
        try:
            xg: XGrammar | None = XGrammar(engine, vocab)
        except ImportError:
            xg = None
        print(f"CPU: {cpu_model()}, torch threads {args.threads}, load average before: {loadavg()}")
        print(f"bundled model: vocab {vocab}; {n_tokens} grammar tokens over {len(SCHEMAS)} schemas")
        print(
            "compile ms, llguidance (grammar + matcher):",
            {
                k: round(v, 2)
                for k, v in compile_ms(lambda s: GrammarMask(engine.tokenizer, json_schema_grammar(s)), SCHEMAS).items()
            },
        )
        if xg is not None:
            print("compile ms, xgrammar:", {k: round(v, 2) for k, v in compile_ms(xg.compile, SCHEMAS).items()})
        decode_all, ll_all, xg_all = [], [], []
        for r in range(args.rounds):
            d = decode_steps(engine, args.decode_tokens)
            ll = llguidance_steps(engine, seqs, vocab)
            row = f"round {r}: decode step {statistics.median(d) * 1e3:.3f} ms"
            row += f", llguidance {statistics.median(ll) * 1e6:.1f} us"
            decode_all += d
            ll_all += ll
            if xg is not None:
                x, refused = xg.steps(seqs)
                xg_all += x
                row += f", xgrammar {statistics.median(x) * 1e6:.1f} us" + (f" ({refused} refused)" if refused else "")
            print(row + f"  [load {loadavg()}]")
        dm = statistics.median(decode_all)
        lm = statistics.median(ll_all)
        print(f"median decode step {dm * 1e3:.3f} ms")
        print(
            f"llguidance: median {lm * 1e6:.1f} us/token = {lm / dm * 100:.1f}% of a decode step "
            f"(p90 {statistics.quantiles(ll_all, n=10)[-1] * 1e6:.1f} us)"
        )
        if xg_all:
            xm = statistics.median(xg_all)
            print(
                f"xgrammar:   median {xm * 1e6:.1f} us/token = {xm / dm * 100:.1f}% of a decode step "
                f"(p90 {statistics.quantiles(xg_all, n=10)[-1] * 1e6:.1f} us)"
            )
        print(f"load average after: {loadavg()}; pid {os.getpid()}")


if __name__ == "__main__":
    main()
