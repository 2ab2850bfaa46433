"""Defaults shared by the CLI subcommands, the daemon and the SDK: one value each, set here only."""

from __future__ import annotations

from fate_edge.devices.detect import thread_split

# Expert memory (cache + read buffers + the expert being computed). "auto": what this machine can give after the
# runtime, resident weights, KV cache and a headroom, capped at every expert (runtime.auto_budget); a size such as
# 256MB is a hard budget, refused at start when this machine cannot hold it.
MEMORY_BUDGET = "auto"
# Tokens (prompt and answer) the memory account reserves KV cache and activations for.
CONTEXT_TOKENS = 4096
POLICY = "fate-edge"  # our preset (fate_edge.runtime.policy.PRESETS); "auto" asks the planner
DEVICE = "auto"  # cuda when torch sees a GPU, else cpu
DTYPE = "auto"  # the hardware's native compute dtype, measured on CPUs with bf16 instructions (compute_dtype)
VERIFY = "once"  # check each blob's CRC32 on its first read
# torch CPU threads + fetch workers: no more than the cores this process may use (fate_edge.devices.detect) while
# experts stream; "auto" gives a real model its budget holds whole every core once loaded (runtime.auto_threads)
THREADS: int | str | None = "auto"
STREAMING_THREADS: int = thread_split()[0]
FETCH_WORKERS: int = thread_split()[1]
