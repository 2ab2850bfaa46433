import mmap
import os
import threading
import time
import zlib

import pytest
from _corrupt import flip_byte
from fate_edge.devices.link import LinkSpec, ThrottledLink

from fate_edge.errors import CorruptBlobError, FetchCancelled, FetchError
from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
from fate_edge.format.blob import ALIGN, BlobRef

BLOB = 64 * 1024


@pytest.fixture()
def blob_file(tmp_path):
    """16 blobs of 64 KB of distinct random bytes, aligned like an expert store."""
    path = tmp_path / "experts-4.bin"
    refs = []
    with path.open("wb") as f:
        for i in range(16):
            data = os.urandom(BLOB - 100)  # payload shorter than the aligned slot, as in a real store
            off = f.tell()
            f.write(data + b"\0" * (BLOB - len(data)))
            refs.append(BlobRef(str(path), off, len(data), zlib.crc32(data), layer=i // 4, expert=i % 4, bits=4))
    return path, refs


def _expected(path, ref):
    with open(path, "rb") as f:
        f.seek(ref.offset)
        return f.read(ref.length)


def test_reads_verify_and_release(blob_file):
    path, refs = blob_file
    with FetchEngine(BufferPool(4, BLOB), workers=2) as eng:
        for ref in refs:
            req = eng.submit(ref)
            assert bytes(eng.wait(req)) == _expected(path, ref)
            assert req.read_s > 0 and req.bytes_read == ref.read_length
            eng.release(req)
        assert eng.pool.available == 4
        assert eng.stats.bytes_read == sum(r.read_length for r in refs)
        assert eng.direct_io_note  # says which I/O path ran


def test_duplicate_requests_merge_and_upgrade(blob_file):
    _, refs = blob_file
    gate = threading.Event()
    with FetchEngine(BufferPool(2, BLOB), workers=1, fault_injector=lambda r: gate.wait()) as eng:
        first = eng.submit(refs[0], Priority.AHEAD)  # occupies the single worker until the gate opens
        time.sleep(0.05)
        a = eng.submit(refs[1], Priority.AHEAD)
        b = eng.submit(refs[1], Priority.DEMAND)
        assert a is b and a.priority == Priority.DEMAND
        gate.set()
        eng.wait(first), eng.wait(a)
        assert eng.stats.merged == 1 and eng.stats.reads_completed == 2


def test_demand_overtakes_queued_prefetches(blob_file):
    _, refs = blob_file
    order = []
    gate = threading.Event()

    def record(ref):
        gate.wait()
        order.append(ref.key)

    with FetchEngine(BufferPool(8, BLOB), workers=1, fault_injector=record) as eng:
        blocker = eng.submit(refs[0], Priority.AHEAD)
        time.sleep(0.05)
        prefetches = [eng.submit(r, Priority.AHEAD) for r in refs[1:6]]
        nxt = eng.submit(refs[6], Priority.NEXT_LAYER)
        demand = eng.submit(refs[7], Priority.DEMAND)
        gate.set()
        for r in [blocker, *prefetches, nxt, demand]:
            eng.wait(r)
            eng.release(r)
    assert order[0] == refs[0].key  # was already being read
    assert order[1] == refs[7].key and order[2] == refs[6].key
    assert order[3:] == [r.key for r in refs[1:6]]


def test_cancelled_prefetch_does_no_io_after_cancellation(blob_file):
    _, refs = blob_file
    slow = ThrottledLink(LinkSpec("slow", bandwidth_bytes_per_s=100_000))  # 64 KB takes ~0.65 s, 41 ms a chunk
    with FetchEngine(BufferPool(4, BLOB), workers=1, link=slow, chunk_bytes=ALIGN) as eng:
        reading = eng.submit(refs[0], Priority.AHEAD)
        queued = eng.submit(refs[1], Priority.AHEAD)
        deadline = time.time() + 10
        while reading.bytes_read == 0 and time.time() < deadline:  # wait until it is part way through
            time.sleep(0.001)
        eng.cancel(reading)
        eng.cancel(queued)
        with pytest.raises(FetchCancelled):
            eng.wait(reading)
        with pytest.raises(FetchCancelled):
            eng.wait(queued)
        read_at_cancel = reading.bytes_read
        time.sleep(0.1)
        assert queued.bytes_read == 0
        assert 0 < read_at_cancel < refs[0].read_length
        assert reading.bytes_read == read_at_cancel  # no I/O after the cancellation took effect
        assert eng.pool.available == 4


def test_flipped_byte_is_reported_with_layer_and_expert(blob_file):
    path, refs = blob_file
    ref = refs[6]
    flip_byte(path, ref.offset + 1234)
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        with pytest.raises(CorruptBlobError, match=rf"layer {ref.layer} expert {ref.expert}.*offset {ref.offset}"):
            eng.wait(eng.submit(ref))
        assert eng.pool.available == 2
        ok = eng.submit(refs[0])  # the engine keeps serving
        assert bytes(eng.wait(ok)) == _expected(path, refs[0])


def test_a_read_lands_in_the_callers_memory_checked_and_no_pool_buffer_kept(blob_file):
    path, refs = blob_file
    mem = mmap.mmap(-1, 2 * BLOB)  # page-aligned, as a host-tier slot is (O_DIRECT)
    with FetchEngine(BufferPool(2, BLOB), workers=1, verify="always") as eng:
        into = memoryview(mem)[:BLOB]
        req = eng.submit(refs[2], into=into)
        payload = eng.wait(req)
        assert req.into is into and bytes(payload) == bytes(into[: refs[2].length]) == _expected(path, refs[2])
        eng.release(req)
        assert eng.pool.available == 2  # the caller's memory never joined the pool
        flip_byte(path, refs[7].offset + 99)
        bad = eng.submit(refs[7], into=memoryview(mem)[BLOB:])
        with pytest.raises(CorruptBlobError, match=rf"layer {refs[7].layer} expert {refs[7].expert}"):
            eng.wait(bad)
        eng.release(bad)
        assert eng.pool.available == 2
        with pytest.raises(ValueError, match="bytes to read into"):
            eng.submit(refs[3], into=memoryview(mem)[:100])


def test_verify_once_checks_first_read_and_always_checks_every_read(blob_file):
    path, refs = blob_file
    ref = refs[3]
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:  # default: verify once
        req = eng.submit(ref)
        assert bytes(eng.wait(req)) == _expected(path, ref)
        eng.release(req)
        # Corrupt the bytes behind the file's back while keeping its identity (inode and mtime), as a
        # bit flip on the medium would: a verified blob is trusted on re-reads ...
        st = os.stat(path)
        flip_byte(path, ref.offset + 10)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        again = eng.submit(ref)
        assert bytes(eng.wait(again)) == _expected(path, ref)  # the flipped bytes, served without a CRC check
        eng.release(again)
    # ... while verify="always" checks each read and catches it.
    with FetchEngine(BufferPool(2, BLOB), workers=1, verify="always") as eng:
        with pytest.raises(CorruptBlobError, match=rf"layer {ref.layer} expert {ref.expert}"):
            eng.wait(eng.submit(ref))


def test_rewritten_file_is_verified_again(blob_file):
    path, refs = blob_file
    ref = refs[5]
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        req = eng.submit(ref)
        eng.wait(req)
        eng.release(req)
    # A store rewritten in place of the old one is a new file: nothing verified in the old one carries over.
    data = bytearray(path.read_bytes())
    data[ref.offset + 7] ^= 0xFF
    tmp = path.with_suffix(".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        with pytest.raises(CorruptBlobError, match=rf"layer {ref.layer} expert {ref.expert}"):
            eng.wait(eng.submit(ref))


def test_verify_rejects_unknown_mode():
    with pytest.raises(ValueError, match="once.*always"):
        FetchEngine(BufferPool(1, BLOB), workers=1, verify="sometimes")


def test_truncated_file_is_reported(blob_file):
    path, refs = blob_file
    os.truncate(path, refs[-1].offset + 1000)
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        with pytest.raises(FetchError, match=rf"layer {refs[-1].layer} expert {refs[-1].expert}.*truncated"):
            eng.wait(eng.submit(refs[-1]))


def test_throttle_delivers_its_bandwidth_on_64mb():
    bw = 256e6
    link = ThrottledLink(LinkSpec("emulated", bandwidth_bytes_per_s=bw))
    chunk = 1 << 20
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda: [link.reserve(chunk) for _ in range(16)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    measured = 64 * chunk / elapsed
    assert abs(measured - bw) / bw < 0.10, f"throttled bandwidth {measured / 1e6:.0f} MB/s vs {bw / 1e6:.0f}"


def test_throttled_engine_reads_at_link_speed(blob_file):
    _, refs = blob_file
    bw = 8e6  # 16 x 64 KB = 1 MB in ~0.13 s
    with FetchEngine(BufferPool(16, BLOB), workers=2, link=ThrottledLink(LinkSpec("x", bw))) as eng:
        t0 = time.perf_counter()
        reqs = [eng.submit(r, Priority.AHEAD) for r in refs]
        for r in reqs:
            eng.wait(r)
        elapsed = time.perf_counter() - t0
    total = sum(r.read_length for r in refs)
    assert elapsed >= total / bw * 0.95


def test_more_requests_than_buffers_never_deadlock(blob_file):
    path, refs = blob_file
    with FetchEngine(BufferPool(2, BLOB), workers=2) as eng:
        reqs = [eng.submit(r, Priority.AHEAD) for r in refs]  # 16 requests, 2 buffers
        for ref, req in zip(refs, reqs):  # a caller consuming strictly in submission order
            assert bytes(eng.wait(req, timeout=30)) == _expected(path, ref)
            eng.release(req)
        assert eng.pool.available == 2


def test_engine_reads_64mb_at_the_emulated_link_bandwidth(tmp_path):
    """64 MB of 1 MB blobs through the engine over a 200 MB/s link: delivered within 10% of it."""
    path = tmp_path / "experts-4.bin"
    blob = 1 << 20
    data = os.urandom(blob)
    with path.open("wb") as f:
        for _ in range(64):
            f.write(data)
    crc = zlib.crc32(data)
    refs = [BlobRef(str(path), i * blob, blob, crc, layer=i // 8, expert=i % 8, bits=4) for i in range(64)]
    bw = 200e6
    link = ThrottledLink(LinkSpec("200 MB/s", bw))
    with FetchEngine(BufferPool(8, blob), workers=2, link=link, direct_io=False) as eng:
        warm = eng.submit(refs[0])  # open the file descriptor and warm the page cache path first
        eng.wait(warm)
        eng.release(warm)
        link._free_at = 0.0
        t0 = time.perf_counter()
        pending = []
        for r in refs:
            pending.append(eng.submit(r, Priority.AHEAD))
            while len(pending) >= 8 or (r is refs[-1] and pending):
                req = pending.pop(0)
                eng.wait(req)
                eng.release(req)
        elapsed = time.perf_counter() - t0
    measured = 64 * blob / elapsed
    assert abs(measured - bw) / bw < 0.10, f"{measured / 1e6:.0f} MB/s through the engine vs a {bw / 1e6:.0f} MB/s link"


class _HeldLink:
    """An emulated link that holds every chunk until released: a worker stuck part way through a read."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def reserve(self, nbytes, first_chunk=False, issued_at=None):
        self.entered.set()
        self.release.wait()
        return 0.0


def test_close_never_closes_a_file_a_worker_is_still_reading(blob_file):
    path, refs = blob_file
    link = _HeldLink()
    eng = FetchEngine(BufferPool(2, BLOB), workers=1, link=link, chunk_bytes=ALIGN)
    eng.close_timeout = 0.1  # close() gives up waiting long before the worker is released
    req = eng.submit(refs[0], Priority.AHEAD)
    assert link.entered.wait(30)  # the worker has the file open and one chunk read
    fd = eng._fds[str(path)]
    eng.close()
    os.fstat(fd)  # still open: a closed (or reused) descriptor would be read by the worker next
    link.release.set()
    eng._threads[0].join(30)
    assert not eng._threads[0].is_alive()
    assert req.state == "cancelled" and req.error is None  # stopped at its next chunk, no read of a closed fd
    assert 0 < req.bytes_read < refs[0].read_length
    assert not eng._fds and eng.pool.available == 2  # the last worker closed the file and gave its buffer back


def test_close_waits_for_a_reader_with_the_default_worker_count(blob_file):
    """With ``workers`` left to its default, the engine still counts its live workers: close() leaves an open file to
    the reader, which closes it on its way out (the count was None, so the file was closed under the read)."""
    path, refs = blob_file
    link = _HeldLink()
    eng = FetchEngine(BufferPool(2, BLOB), link=link, chunk_bytes=ALIGN)
    eng.close_timeout = 0.1
    req = eng.submit(refs[0], Priority.AHEAD)
    assert link.entered.wait(30)
    fd = eng._fds[str(path)]
    eng.close()
    os.fstat(fd)  # still open under the worker's read
    link.release.set()
    for t in eng._threads:
        t.join(30)
    assert req.state == "cancelled" and req.error is None
    assert not eng._fds  # the last worker closed the file


def test_promoted_prefetch_is_read_next(blob_file):
    _, refs = blob_file
    order, gate = [], threading.Event()

    def record(ref):
        gate.wait()
        order.append(ref.key)

    with FetchEngine(BufferPool(8, BLOB), workers=1, fault_injector=record) as eng:
        blocker = eng.submit(refs[0], Priority.AHEAD)
        time.sleep(0.05)  # the single worker is now held on the blocker
        ahead = [eng.submit(r, Priority.AHEAD) for r in refs[1:5]]
        eng.promote(ahead[-1], Priority.DEMAND)  # the layer needs it now
        assert ahead[-1].priority == Priority.DEMAND
        gate.set()
        for r in [blocker, *ahead]:
            eng.wait(r)
            eng.release(r)
    assert order[1] == refs[4].key and order[2:] == [r.key for r in refs[1:4]]


def test_verified_blobs_are_bounded_and_keep_the_most_recently_checked():
    from fate_edge.format.blob import VerifiedBlobs

    seen = VerifiedBlobs(max_entries=3)
    for i in range(4):
        seen.add(("store", i))
    assert len(seen) == 3 and ("store", 0) not in seen
    assert ("store", 1) in seen  # a lookup refreshes it ...
    seen.add(("store", 4))
    assert ("store", 1) in seen and ("store", 2) not in seen  # ... so the least recently checked goes

    errors = []

    def hammer(t):
        try:
            for i in range(3000):
                seen.add((t, i))
                (t, i - 1) in seen  # noqa: B015 (a lookup moves the key: it mutates too)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost every bytecode: races show at once
    try:
        threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and len(seen) == 3


def test_a_blob_forgotten_by_the_bounded_set_is_verified_again(blob_file, monkeypatch):
    from fate_edge.format import blob

    monkeypatch.setattr(blob.VERIFIED_BLOBS, "max_entries", 4)  # the process-wide set, bounded
    path, refs = blob_file
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        for ref in refs:  # 16 blobs through a set of 4
            req = eng.submit(ref)
            eng.wait(req)
            eng.release(req)
        assert len(blob.VERIFIED_BLOBS) == 4
        st = os.stat(path)
        flip_byte(path, refs[0].offset + 10)  # first blob: verified, then forgotten
        flip_byte(path, refs[-1].offset + 10)  # last blob: still remembered
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(CorruptBlobError, match=rf"layer {refs[0].layer} expert {refs[0].expert}"):
            eng.wait(eng.submit(refs[0]))
        last = eng.submit(refs[-1])
        assert bytes(eng.wait(last)) == _expected(path, refs[-1])  # trusted: read without a CRC, as before
