"""A prompt's temporaries from glibc's heap (fate_edge.runtime.prompt_heap): the mmap threshold rises only on an
engine that copies no expert into memory of its own, and only while no open engine does; it is 1 MiB again once the
last engine that raised it closes. Checked on glibc itself, in fresh processes (tests/_prompt_heap_child.py): whether
a fresh 24 MiB block is a mapping of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, return_freed_blobs_to_the_os
from fate_edge.model.arch import load_config
from fate_edge.runtime import prompt_heap
from fate_edge.runtime.memory_account import buffer_bytes, memory_account

CHILD = Path(__file__).parent / "_prompt_heap_child.py"
glibc = pytest.mark.skipif(not return_freed_blobs_to_the_os(), reason="glibc's mallopt is not in this process")


def run_child(*args: str) -> None:
    done = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == f"OK {args[0]}", done.stderr


@pytest.fixture(scope="module")
def int4_and_int8_stores(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("heap")
    opts = dict(keep_bf16=False, layout="portable", threads=1)
    return {
        bits: convert(bundled_dir, root / f"int{bits}", ConvertOptions.full(bits=bits, **opts), progress=False)
        for bits in (4, 8)
    }


@glibc
@pytest.mark.parametrize(
    "scenario",
    ["raised_until_closed", "copying_keeps_one_mib", "copying_later_sets_it_back", "last_of_two_sets_it_back"],
)
def test_the_threshold_follows_the_engines(scenario):
    run_child(scenario)


@glibc
def test_engines_on_real_stores(int4_and_int8_stores):
    run_child("real_engines", str(int4_and_int8_stores[4]), str(int4_and_int8_stores[8]))


def test_the_account_holds_more_for_a_chunk_served_from_the_heap(int4_and_int8_stores):
    int4, int8 = int4_and_int8_stores[4], int4_and_int8_stores[8]
    heap = memory_account(int4, 3_000_000, "bfloat16", 256)
    mapped = memory_account(int8, 3_000_000, "bfloat16", 256)
    cfg = load_config(int4)
    fixed = buffer_bytes(cfg, torch.bfloat16, 0)
    per_chunk = buffer_bytes(cfg, torch.bfloat16, 256) - fixed
    assert mapped.buffers == fixed + per_chunk
    assert heap.buffers == (fixed + 2 * per_chunk if prompt_heap.views_only(ExpertStore(int4)) else mapped.buffers)
