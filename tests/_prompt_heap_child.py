"""The prompt heap's scenarios (fate_edge.runtime.prompt_heap), each in a fresh process, so that glibc's heap holds no
free chunk left by earlier tests: such a chunk serves a block from the heap whatever the threshold, and the probe
below (whether a fresh block is a mapping of its own) would misread it.

Run as ``python _prompt_heap_child.py SCENARIO [INT4_STORE INT8_STORE]`` by tests/test_prompt_heap.py; a failed
check is a traceback and a non-zero exit.
"""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace
from typing import cast

from fate_edge.format.store import ExpertStore, return_freed_blobs_to_the_os
from fate_edge.runtime import prompt_heap
from fate_edge.runtime.engine import Engine, EngineConfig
from fate_edge.runtime.generate import GenerateConfig

_IS_MMAPPED = 0x2  # glibc's chunk header: the size word before the block, its second bit


def block_is_a_mapping(nbytes: int = 24 << 20) -> bool:
    """Whether glibc serves a fresh ``nbytes`` block as a mapping of its own (above its mmap threshold: 1 MiB once a
    store is open, 32 MiB raised)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(nbytes)
    assert p
    try:
        return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & _IS_MMAPPED)
    finally:
        libc.free(p)


def views_store() -> ExpertStore:
    return cast(ExpertStore, SimpleNamespace(precisions={}))  # no precision that copies: views only


def raised_until_closed() -> None:
    assert block_is_a_mapping()
    claim = prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(claim, True, views_store())
    assert not block_is_a_mapping()
    assert block_is_a_mapping(40 << 20)  # past the raised threshold a block is a mapping still
    prompt_heap.engine_closed(claim)
    assert block_is_a_mapping()


def copying_keeps_one_mib() -> None:
    copying, keeping = prompt_heap.Claim(), prompt_heap.Claim()
    assert not prompt_heap.serve_from_heap(copying, False, views_store())
    assert not prompt_heap.serve_from_heap(keeping, True, views_store())  # not while the copying engine is open
    assert block_is_a_mapping()
    prompt_heap.engine_closed(copying)
    prompt_heap.engine_closed(keeping)
    assert block_is_a_mapping()


def copying_later_sets_it_back() -> None:
    first, later = prompt_heap.Claim(), prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(first, True, views_store())
    assert not block_is_a_mapping()
    assert not prompt_heap.serve_from_heap(later, False, views_store())
    assert block_is_a_mapping()
    prompt_heap.engine_closed(first)  # closing the first does not raise it again
    assert block_is_a_mapping()


def last_of_two_sets_it_back() -> None:
    a, b = prompt_heap.Claim(), prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(a, True, views_store())
    assert prompt_heap.serve_from_heap(b, True, views_store())
    prompt_heap.engine_closed(a)
    assert not block_is_a_mapping()
    prompt_heap.engine_closed(b)
    assert block_is_a_mapping()


def real_engines(int4: str, int8: str) -> None:
    """The int4 store's experts stay in their read buffers (views, where the native kernel runs); the int8 store's
    decode into memory of their own: the threshold rises for the first only, and not while the second is open."""
    views = prompt_heap.views_only(ExpertStore(int4))
    assert not prompt_heap.views_only(ExpertStore(int8))
    with Engine(EngineConfig(int4, 3_000_000, "lru", dtype="bfloat16")) as engine:
        assert engine.scheduler.zero_copy == views
        assert block_is_a_mapping() != views
        with Engine(EngineConfig(int8, 8_000_000, "lru", dtype="bfloat16")):
            assert block_is_a_mapping()
        assert block_is_a_mapping()  # no engine raises it again while one that raised it is still open
    assert block_is_a_mapping()
    with Engine(EngineConfig(int4, 3_000_000, "lru", dtype="bfloat16")) as engine:
        steps = list(engine.stream(list(range(1, 40)), GenerateConfig(max_tokens=4, ignore_eos=True)))
        assert len(steps) == 4 and block_is_a_mapping() != views
    assert block_is_a_mapping()


if __name__ == "__main__":
    return_freed_blobs_to_the_os()  # as every engine's store sets it when opened
    globals()[sys.argv[1]](*sys.argv[2:])
    print("OK", sys.argv[1])
