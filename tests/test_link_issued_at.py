"""devices.link: with ``issued_at`` the emulated transfer overlaps the real read instead of following it.

A fake clock (``sleep`` advances ``monotonic`` exactly) keeps these exact on a loaded host.
"""

import fate_edge.devices.link as link_mod
import pytest
from fate_edge.devices.link import LinkSpec, ThrottledLink


class FakeTime:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@pytest.fixture()
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(link_mod, "time", fake)
    return fake


def test_transfer_overlaps_the_real_read(clock):
    link = ThrottledLink(LinkSpec("test", 1e9, 0.0))  # 1 GB/s: 10 MB take 10 ms
    issued = clock.monotonic()
    clock.sleep(0.02)  # the real read took longer than the emulated transfer
    assert link.reserve(10_000_000, first_chunk=True, issued_at=issued) == 0.0
    clock.sleep(0.02)
    assert link.reserve(10_000_000, first_chunk=True) == pytest.approx(0.01)  # without: starts after the read


@pytest.mark.parametrize("overlap", [True, False])
def test_chunks_of_one_request_stream_at_the_link_bandwidth(clock, overlap):
    link = ThrottledLink(LinkSpec("test", 0.5e9, 100e-6))
    chunk, chunks, read_s = 256 * 1024, 40, 200e-6  # the link needs 524 µs per chunk, the read 200 µs
    t0 = clock.monotonic()
    for i in range(chunks):
        clock.sleep(read_s)
        link.reserve(chunk, first_chunk=i == 0, issued_at=t0 if overlap else None)
    elapsed = clock.monotonic() - t0
    on_link = 100e-6 + chunk * chunks / 0.5e9
    if overlap:  # reads hidden under the transfer: exactly the link's time
        assert elapsed == pytest.approx(on_link)
    else:  # each chunk pays its read and then its transfer
        assert elapsed == pytest.approx(on_link + chunks * read_s)
