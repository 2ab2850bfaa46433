"""A batched decode step with its recurrent layers' rows stepped together against each alone (docs/batching.md).

Loads a checkpoint (a small Qwen3-Next: `fate-edge synth --like qwen3-next-80b-a3b --layers 4 --scale 4 DIR`),
prefills B sequences of 32 tokens, then times decode steps of all B (`batch_step.forward_segments`) with
`BatchState.stack_recurrent` True and False on two copies of the caches, interleaved (the order alternating each
step), one torch thread. Prints per B the median step time and the median time inside the recurrent layers' mixers
(their projections included), and whether both produced the same tokens.

    .venv/bin/python scripts/recurrent_batch_step.py DIR bfloat16 40
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from fate_edge.model import batch_step
from fate_edge.model.batch_step import BatchState, Segment, forward_segments
from fate_edge.runtime.loader import load_model

_mix = batch_step.mix
spent = [0.0]


def timed_mix(cfg, h, b, t, layer, lp, state, cos, sin):
    """``recurrent.mix``, timed where the layer is not attention."""
    if lp.mixer == "attention":
        return _mix(cfg, h, b, t, layer, lp, state, cos, sin)
    t0 = time.perf_counter()
    out = _mix(cfg, h, b, t, layer, lp, state, cos, sin)
    spent[0] += time.perf_counter() - t0
    return out


def main(path: str, dtype: str, steps: int) -> None:
    torch.set_num_threads(1)
    batch_step.mix = timed_mix
    model = load_model(path, dtype=getattr(torch, dtype))
    print("layers", [model.config.mixer(i) for i in range(model.config.num_hidden_layers)])
    for b in (4, 8):
        sets = {}
        for mode in (True, False):
            segs = [Segment([(17 * j + 5 * i) % 1000 + 10 for i in range(32)], model.new_cache()) for j in range(b)]
            for s in segs:  # prompts one at a time
                s.ids = [int(forward_segments(model, [s])[0].argmax())]
            sets[mode] = segs
        times: dict[bool, list[float]] = {True: [], False: []}
        mixers: dict[bool, list[float]] = {True: [], False: []}
        for step in range(steps + 5):
            for mode in (True, False) if step % 2 == 0 else (False, True):
                BatchState.stack_recurrent = mode
                spent[0] = 0.0
                t = time.perf_counter()
                logits = forward_segments(model, sets[mode])
                dt = time.perf_counter() - t
                for s, row in zip(sets[mode], logits):
                    s.ids = [int(row.argmax())]
                if step >= 5:  # warm-up steps dropped
                    times[mode].append(dt)
                    mixers[mode].append(spent[0])
        BatchState.stack_recurrent = True
        same = all(a.ids == c.ids for a, c in zip(sets[True], sets[False]))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        m_on, m_off = statistics.median(mixers[True]), statistics.median(mixers[False])
        print(
            f"B={b}: step stacked {on * 1e3:.2f} ms, one at a time {off * 1e3:.2f} ms ({off / on:.2f}x); recurrent "
            f"mixers {m_on * 1e3:.2f} vs {m_off * 1e3:.2f} ms ({m_off / m_on:.2f}x); same tokens {same}; "
            f"loadavg {' '.join(open('/proc/loadavg').read().split()[:3])}"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bfloat16", int(sys.argv[3]) if len(sys.argv) > 3 else 40)
