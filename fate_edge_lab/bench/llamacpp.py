"""Running llama.cpp (llama-cpp-python) on the same prompt token ids as fate-edge, and timing either side the
same way: prefill = time to the first generated token, decode = the tokens after it over their time."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PROGRESS = "progress"  # the key of a child's JSON lines saying how far it got (sidebyside.child_main)


def time_tokens(stream: Iterable[int | None], n_prompt: int, want: int) -> dict[str, Any]:
    """Consume ``want`` tokens of a greedy ``stream`` started just now; tok/s of prefill and of decode."""
    t0, c0, times, tokens, cpu_first = time.perf_counter(), time.process_time(), [], [], 0.0
    for tok in stream:
        times.append(time.perf_counter())
        if len(times) == 1:
            cpu_first = time.process_time()
        tokens.append(None if tok is None else int(tok))
        if len(tokens) >= want:
            break
    # Prompt and decode tokens per second of this process's CPU time too: on a busy host wall time counts the waits
    # for a core (at one thread; more threads' CPU time counts their spin-waits at barriers as well).
    out: dict[str, Any] = {
        "prefill_tps": n_prompt / (times[0] - t0),
        "tokens": tokens,
        "decode_tps": None,
        "prefill_cpu_tps": n_prompt / max(cpu_first - c0, 1e-9),
    }
    if len(times) > 1 and times[-1] > times[0]:
        out["decode_tps"] = (len(times) - 1) / (times[-1] - times[0])
        out["decode_cpu_tps"] = (len(times) - 1) / max(time.process_time() - cpu_first, 1e-9)
    return out


# Prepended to a llama.cpp child's code. llama.cpp links the system libgomp, which reads OMP_WAIT_POLICY once, when
# it loads; torch bundles a libgomp with the same soname, so whichever loads first serves both. Loading llama_cpp
# before anything imports torch, without the OpenMP settings importing fate_edge makes for torch (inherited by
# children, named in FATE_EDGE_SET_OPENMP), gives llama.cpp its own default: with our former PASSIVE its decode was
# 20x slower here (72 vs 1674 tok/s, q4_0 bundled model, 2 threads). A value the user set is kept.
OPENMP_DEFAULT = (
    "import os\n"
    "for _name in filter(None, os.environ.pop('FATE_EDGE_SET_OPENMP', '').split(',')):\n"
    "    os.environ.pop(_name, None)\n"
)


def llama_child(code: str) -> str:
    """``code`` for a fresh interpreter that will run llama.cpp, with llama.cpp's own OpenMP runtime set up first."""
    return OPENMP_DEFAULT + "import llama_cpp  # noqa: F401\n" + code


def open_llama(gguf: str | Path, n_ctx: int, threads: int, mmap: bool, repack: bool = True):
    """A Llama on ``gguf`` with ``threads`` for both decode and prefill (llama.cpp's batch threads default to
    all cores otherwise), fully read into RAM (``mmap=False``) or memory-mapped. Run it in a process started
    with :func:`llama_child`.

    ``repack=False`` is llama-cli's ``--no-repack``: by default llama.cpp's CPU backend copies every Q4_0 matrix
    it can into an anonymous ``CPU_REPACK`` buffer (q4_0_8x8 here), so a "memory-mapped" q4_0 model is in fact
    held in RAM; at real size (8 GB) that is OOM-killed under any cap below the model. Off, the weights stay
    mapped and the page cache holds what fits."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    default_params = lib.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = repack
        return p

    lib.llama_model_default_params = params  # Llama() takes no such argument; it asks this function
    try:
        return Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, use_mmap=mmap, verbose=False
        )
    finally:
        lib.llama_model_default_params = default_params


def llama_stream(llm, ids: list[int]):
    """Greedy tokens after ``ids`` (the prompt as token ids: no tokenizer on llama.cpp's side)."""
    return llm.generate(ids, top_k=1, temp=0.0, reset=True)


def tokens_agree(llm, text: str, ids: list[int]) -> dict[str, Any]:
    """Does llama.cpp tokenize ``text`` to our ``ids`` (``Tokenizer.encode``, BOS as the model's tokenizer
    config says)? The bench feeds ids either way; this checks the GGUF's vocabulary, pre-tokenizer and BOS
    flag reproduce ours. ``add_bos=True`` adds BOS only where the GGUF's ``add_bos_token`` says so."""
    theirs = llm.tokenize(text.encode(), add_bos=True, special=False)
    first = next((i for i, (a, b) in enumerate(zip(theirs, ids)) if a != b), None)
    if first is None and len(theirs) != len(ids):
        first = min(len(theirs), len(ids))
    return {"equal": first is None, "ours": len(ids), "llama.cpp": len(theirs), "first_difference": first}


def read_bytes() -> int | None:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes: page faults of a mapped
    file included), or None where the kernel does not report it."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
