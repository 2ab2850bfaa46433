"""Minimal fate-edge SDK script: the bundled model under a 2 MB expert budget (run: python examples/minimal.py)."""

from fate_edge import Engine
from fate_edge.sdk import chat, stream

# The bundled model, converted once to an expert store in ~/.cache/fate-edge (FATE_EDGE_CACHE overrides it).
with Engine.load(memory_budget="2MB", policy="fate-edge") as engine:
    for step in stream(engine, "def fibonacci(n):", max_tokens=32, temperature=0.7, seed=1):
        print(step.text, end="", flush=True)
    print(f"\n[{step.generation_tps:.0f} tok/s, peak RSS {step.peak_rss_bytes / 2**20:.0f} MiB]")

    done = chat(engine, [{"role": "user", "content": "Say hello."}], max_tokens=16)
    print(done.text)
    print(f"[{done.completion_tokens} tokens, finish {done.finish_reason}, expert hit rate {done.stats.hit_rate:.0%}]")
