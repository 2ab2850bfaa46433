"""A prompt's temporaries from glibc's heap (fate_edge.runtime.prompt_heap): the mmap threshold rises only on an
engine that copies no expert into memory of its own, and only while no open engine does; it is 1 MiB again once the
last engine that raised it closes. Checked on glibc itself: whether a fresh 24 MiB block is a mapping of its own."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, return_freed_blobs_to_the_os
from fate_edge.model.arch import load_config
from fate_edge.runtime import prompt_heap
from fate_edge.runtime.engine import Engine, EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.memory_account import buffer_bytes, memory_account

pytestmark = pytest.mark.skipif(prompt_heap._mallopt() is None, reason="glibc's mallopt is not in this process")

_IS_MMAPPED = 0x2  # glibc's chunk header: the size word before the block, its second bit


def block_is_a_mapping(nbytes: int = 24 << 20) -> bool:
    """Whether glibc serves a fresh ``nbytes`` block as a mapping of its own: above its mmap threshold, unless a free
    chunk of the heap holds it (hence a size that no free chunk here reaches, below the raised threshold)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(nbytes)
    assert p
    try:
        return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & _IS_MMAPPED)
    finally:
        libc.free(p)


@pytest.fixture(autouse=True)
def fixed_threshold():
    """Each test starts and ends with the store's 1 MiB setting and no engine on record."""
    return_freed_blobs_to_the_os()
    prompt_heap._raised.clear()
    prompt_heap._copying.clear()
    yield
    return_freed_blobs_to_the_os()
    prompt_heap._raised.clear()
    prompt_heap._copying.clear()


def views_store() -> SimpleNamespace:
    return SimpleNamespace(precisions={})  # no precision that copies: views only


def test_an_engine_that_copies_no_expert_raises_the_threshold_until_it_closes():
    assert block_is_a_mapping()
    claim = prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(claim, True, views_store())
    assert not block_is_a_mapping()
    assert block_is_a_mapping(40 << 20)  # past the raised threshold a block is a mapping still
    prompt_heap.engine_closed(claim)
    assert block_is_a_mapping()


def test_an_engine_that_copies_experts_keeps_one_mib_while_it_is_open():
    copying, keeping = prompt_heap.Claim(), prompt_heap.Claim()
    assert not prompt_heap.serve_from_heap(copying, False, views_store())
    assert not prompt_heap.serve_from_heap(keeping, True, views_store())  # not while the copying engine is open
    assert block_is_a_mapping()
    prompt_heap.engine_closed(copying)
    prompt_heap.engine_closed(keeping)
    assert block_is_a_mapping()


def test_a_copying_engine_opened_later_sets_one_mib_back():
    first, later = prompt_heap.Claim(), prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(first, True, views_store())
    assert not block_is_a_mapping()
    assert not prompt_heap.serve_from_heap(later, False, views_store())
    assert block_is_a_mapping()
    prompt_heap.engine_closed(first)  # closing the first does not raise it again
    assert block_is_a_mapping()


def test_the_last_of_two_raising_engines_sets_it_back():
    a, b = prompt_heap.Claim(), prompt_heap.Claim()
    assert prompt_heap.serve_from_heap(a, True, views_store())
    assert prompt_heap.serve_from_heap(b, True, views_store())
    prompt_heap.engine_closed(a)
    assert not block_is_a_mapping()
    prompt_heap.engine_closed(b)
    assert block_is_a_mapping()


@pytest.fixture(scope="module")
def int4_and_int8_stores(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("heap")
    opts = dict(keep_bf16=False, layout="portable", threads=1)
    return {
        bits: convert(bundled_dir, root / f"int{bits}", ConvertOptions.full(bits=bits, **opts), progress=False)
        for bits in (4, 8)
    }


def test_engines_on_real_stores(int4_and_int8_stores, one_thread):
    """The int4 store's experts stay in their read buffers (views, where the native kernel runs); the int8 store's
    decode into memory of their own: the threshold rises for the first only, and only while the second is closed."""
    int4, int8 = int4_and_int8_stores[4], int4_and_int8_stores[8]
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
        assert len(steps) == 4 and not block_is_a_mapping() == views
    assert block_is_a_mapping()


def test_the_account_holds_more_for_a_chunk_served_from_the_heap(int4_and_int8_stores):
    int4, int8 = int4_and_int8_stores[4], int4_and_int8_stores[8]
    heap = memory_account(int4, 3_000_000, "bfloat16", 256)
    mapped = memory_account(int8, 3_000_000, "bfloat16", 256)
    cfg = load_config(int4)
    fixed = buffer_bytes(cfg, torch.bfloat16, 0)
    per_chunk = buffer_bytes(cfg, torch.bfloat16, 256) - fixed
    assert mapped.buffers == fixed + per_chunk
    assert heap.buffers == (fixed + 2 * per_chunk if prompt_heap.views_only(ExpertStore(int4)) else mapped.buffers)
