"""Weights quantized at load and the fetch engine's read buffers on transparent huge pages
(``fate_edge.huge_pages``): the same values in a new allocation, only for large contiguous CPU tensors, and nothing
more resident than the tensor or the buffer."""

import ctypes
import gc
import sys
from pathlib import Path

import pytest
import torch

from fate_edge.huge_pages import HUGE_PAGE, MIN_BYTES, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _rss_anon_huge() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_large_tensor_is_copied_with_its_values_and_a_small_one_is_left_as_it_is():
    big = torch.randint(0, 255, (MIN_BYTES // 64 + 7, 64), dtype=torch.uint8)
    out = on_huge_pages(big)
    assert torch.equal(out, big) and out.dtype == big.dtype and out.shape == big.shape and out.is_contiguous()
    if sys.platform.startswith("linux"):
        assert out.data_ptr() != big.data_ptr() and out.data_ptr() % HUGE_PAGE == 0
    small = torch.randn(100)
    assert on_huge_pages(small) is small
    strided = torch.randn(2 * MIN_BYTES // 4).view(-1, 2)[:, 0]
    assert on_huge_pages(strided) is strided  # not contiguous: left as it is
    halves = torch.randn(MIN_BYTES).bfloat16()
    assert torch.equal(on_huge_pages(halves), halves)


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="needs Linux transparent huge pages (madvise or always)"
)
def test_the_copy_lands_in_huge_pages_and_holds_no_more_than_its_bytes():
    t = torch.randint(0, 255, (8 * HUGE_PAGE + 12345,), dtype=torch.uint8)
    before = _rss_anon_huge()
    out = on_huge_pages(t)
    grown = _rss_anon_huge() - before
    assert torch.equal(out, t)
    # whole huge pages inside the tensor, none past it (the advised range stops at its last whole huge page);
    # a busy host may not find every huge page, so at least one
    assert HUGE_PAGE <= grown <= 8 * HUGE_PAGE


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="needs Linux transparent huge pages (madvise or always)"
)
def test_a_read_buffer_lands_in_huge_pages_resident_at_once_and_no_more_than_its_bytes():
    """The fetch engine's read buffers (which become cached experts) on huge pages where they hold whole ones: 2 MB
    aligned (so O_DIRECT's alignment too), faulted in when made, and no huge page past the buffer's end."""
    import psutil

    from fate_edge.fetch.buffer_pool import Buffer

    size = 5 * HUGE_PAGE + 3 * 4096
    proc = psutil.Process()
    gc.collect()
    rss, huge = proc.memory_info().rss, _rss_anon_huge()
    buf = Buffer(size)
    grown, grown_huge = proc.memory_info().rss - rss, _rss_anon_huge() - huge
    assert len(buf.view) == size
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf.view))
    assert address % HUGE_PAGE == 0
    assert size - HUGE_PAGE // 2 <= grown <= size + HUGE_PAGE // 2  # resident now; a huge page past the end: +2 MB
    assert HUGE_PAGE <= grown_huge <= 5 * HUGE_PAGE  # a busy host may not find all five
    buf.view[size - 3 : size] = b"end"
    assert bytes(buf.view[size - 3 :]) == b"end"


def test_a_read_buffer_smaller_than_a_huge_page_is_an_ordinary_page_aligned_mapping():
    from fate_edge.fetch.buffer_pool import Buffer

    buf = Buffer(64 * 4096)
    assert len(buf.view) == 64 * 4096 and ctypes.addressof(ctypes.c_char.from_buffer(buf.view)) % 4096 == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_mapped_tensor_moves_to_huge_pages_and_its_file_pages_leave_the_resident_set(tmp_path):
    """A store's int4 codes (a view of the file's private mapping) copied onto huge pages: the same bytes, 2 MB
    aligned, the file's pages let go behind the copy (resident memory grows by the tensor once, not twice), and the
    mapping still reads the file's bytes if touched again."""
    import psutil

    from fate_edge.huge_pages import moved_to_huge_pages

    nbytes = 6 * HUGE_PAGE + 4096 * 5 + 17
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "codes.bin"
    path.write_bytes(bytes(4096) + data.numpy().tobytes())
    size = path.stat().st_size
    raw = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(str(path), False, size))
    view = raw[4096:]
    proc = psutil.Process()
    gc.collect()
    rss = proc.memory_info().rss
    assert int(view.sum()) == int(data.sum())  # every page of the mapping touched: resident
    touched = proc.memory_info().rss - rss
    assert touched >= nbytes - HUGE_PAGE
    moved = moved_to_huge_pages(view)
    assert torch.equal(moved, data) and moved.data_ptr() % HUGE_PAGE == 0
    grown = proc.memory_info().rss - rss
    assert grown <= nbytes + HUGE_PAGE, f"{grown} bytes resident for a {nbytes}-byte tensor moved"
    assert torch.equal(view, data)  # let go, not lost: the file's bytes again


def test_a_small_or_strided_mapped_tensor_is_left_as_it_is():
    from fate_edge.huge_pages import moved_to_huge_pages

    small = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    assert moved_to_huge_pages(small) is small
    strided = torch.randint(0, 255, (2 * MIN_BYTES,), dtype=torch.uint8)[::2]
    assert moved_to_huge_pages(strided) is strided


def test_where_the_kernel_never_gives_huge_pages_nothing_is_copied_or_moved(monkeypatch):
    """THP ``never``: a mapped tensor stays in its file's (reclaimable) pages and a tensor made in memory where it is;
    a read buffer is the ordinary populated mapping."""
    import fate_edge.huge_pages as hp
    from fate_edge.fetch.buffer_pool import Buffer

    monkeypatch.setattr(hp, "thp_available", lambda: False)
    t = torch.randint(0, 255, (2 * MIN_BYTES,), dtype=torch.uint8)
    assert hp.moved_to_huge_pages(t) is t and hp.on_huge_pages(t) is t
    assert hp.huge_page_window(8 * HUGE_PAGE) is None
    assert len(Buffer(3 * HUGE_PAGE).view) == 3 * HUGE_PAGE
