"""fate_edge.format.checksum: ISA-L's CRC32 gives zlib's values (the store's checksums), whole or chunk by chunk."""

import os
import zlib

from fate_edge.format import checksum


def test_isal_is_the_backend_where_its_wheel_installs():
    # isal is a dependency: on this CI's platform the fast checksum must be the one in use
    assert checksum.BACKEND == "isal"


def test_values_equal_zlib_whole_and_chunked():
    data = os.urandom(3 * 262144 + 12345)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(b"") == zlib.crc32(b"") == 0
    crc = 0
    view = memoryview(data)
    for pos in range(0, len(data), 262144):  # as the reader checks a blob chunk by chunk
        crc = checksum.crc32(view[pos : pos + 262144], crc)
    assert crc == zlib.crc32(data)


def test_a_flipped_bit_changes_the_value():
    data = bytearray(os.urandom(4096))
    before = checksum.crc32(data)
    data[1000] ^= 0x10
    assert checksum.crc32(data) != before


def test_without_isal_the_same_checksum_comes_from_zlib(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "isal", None)  # as on a platform without its wheel: the import fails
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    try:
        fallback = importlib.reload(checksum)
        assert fallback.BACKEND == "zlib"
        data = os.urandom(10_000)
        assert fallback.crc32(data) == zlib.crc32(data)
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    assert checksum.BACKEND == "isal"
