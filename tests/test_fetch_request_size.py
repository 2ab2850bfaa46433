"""How many bytes each read request asks the disk for: a demand read is one request for the whole blob (O_DIRECT's
speed is set by the request size), a read ahead goes in chunks so it can be dropped part way, a read ahead promoted
to demand while it reads asks for all its remaining bytes at once, and reads through an emulated link stay chunked."""

import os
import threading

import pytest
from fate_edge.devices.link import LinkSpec, ThrottledLink

from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
from fate_edge.format.blob import ALIGN, BlobRef
from fate_edge.format.checksum import crc32

BLOB = 16 * ALIGN


@pytest.fixture()
def blob(tmp_path):
    path = tmp_path / "experts-4.bin"
    data = os.urandom(BLOB - 100)
    path.write_bytes(data + b"\0" * 100)
    return BlobRef(str(path), 0, len(data), crc32(data), layer=0, expert=0, bits=4), data


@pytest.fixture()
def requests(monkeypatch):
    """The byte count of every ``os.preadv`` the fetch workers issue; ``hold`` stops the first one of a read
    until released."""
    sizes: list[int] = []
    hold = {"event": None, "entered": threading.Event()}
    real = os.preadv

    def preadv(fd, buffers, offset):
        if threading.current_thread().name.startswith("fate-fetch"):
            sizes.append(sum(len(b) for b in buffers))
            if hold["event"] is not None and len(sizes) == 1:
                hold["entered"].set()
                hold["event"].wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return sizes, hold


def _read(eng, ref, priority):
    req = eng.submit(ref, priority)
    payload = bytes(eng.wait(req, timeout=30))
    eng.release(req)
    return payload


def test_a_demand_read_is_one_request_for_the_whole_blob(blob, requests):
    ref, data = blob
    sizes, _ = requests
    with FetchEngine(BufferPool(2, BLOB), workers=1, chunk_bytes=ALIGN, direct_io=False) as eng:
        assert _read(eng, ref, Priority.DEMAND) == data
    assert sizes == [ref.read_length]


def test_a_read_ahead_goes_in_chunks(blob, requests):
    ref, data = blob
    sizes, _ = requests
    with FetchEngine(BufferPool(2, BLOB), workers=1, chunk_bytes=4 * ALIGN, direct_io=False) as eng:
        assert _read(eng, ref, Priority.AHEAD) == data
    assert sizes == [4 * ALIGN] * 4


def test_a_read_ahead_promoted_while_reading_asks_for_the_rest_at_once(blob, requests):
    ref, data = blob
    sizes, hold = requests
    hold["event"] = threading.Event()
    with FetchEngine(BufferPool(2, BLOB), workers=1, chunk_bytes=4 * ALIGN, direct_io=False) as eng:
        req = eng.submit(ref, Priority.AHEAD)
        assert hold["entered"].wait(30)  # its first chunk is being read
        eng.promote(req, Priority.DEMAND)
        hold["event"].set()
        assert bytes(eng.wait(req, timeout=30)) == data
        eng.release(req)
    assert sizes == [4 * ALIGN, 12 * ALIGN]


def test_reads_through_an_emulated_link_stay_chunked(blob, requests):
    ref, data = blob
    sizes, _ = requests
    link = ThrottledLink(LinkSpec("fast", bandwidth_bytes_per_s=10e9))
    with FetchEngine(BufferPool(2, BLOB), workers=1, link=link, chunk_bytes=4 * ALIGN, direct_io=False) as eng:
        assert _read(eng, ref, Priority.DEMAND) == data
    assert sizes == [4 * ALIGN] * 4
