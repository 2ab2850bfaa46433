"""fate_edge.format.direct_write: convert's output files go past the page cache (O_DIRECT) with the same bytes."""

import errno
import os

import pytest

import fate_edge.format.direct_write as dw
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.direct_write import ALIGN, DirectFile


def _fs_takes_o_direct(directory) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / "probe")
    return True


def test_sequential_writes_across_buffer_boundaries_give_the_same_bytes(tmp_path):
    chunks = [os.urandom(n) for n in (5, 4091, 8192, 1, 20_000, 0, 777)]
    with DirectFile(tmp_path / "f", buffer_bytes=2 * ALIGN) as f:
        for c in chunks:
            assert f.write(c) == len(c)
        assert f.direct == _fs_takes_o_direct(tmp_path)
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_slots_are_written_at_their_offsets_zero_padded_to_the_final_length(tmp_path):
    blob_a, blob_b = os.urandom(5000), os.urandom(3000)
    with DirectFile(tmp_path / "f", buffer_bytes=ALIGN) as f:
        f.pwrite_at(blob_b, 4 * ALIGN)  # out of order, as slots may finish
        f.pwrite_at(blob_a, 0)
        f.truncate(6 * ALIGN)
        with pytest.raises(ValueError, match="multiple of 4096"):
            f.pwrite_at(blob_a, 100)
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 6 * ALIGN
    assert data[:5000] == blob_a and data[4 * ALIGN : 4 * ALIGN + 3000] == blob_b
    assert data[5000 : 4 * ALIGN] == bytes(4 * ALIGN - 5000) and data[4 * ALIGN + 3000 :] == bytes(2 * ALIGN - 3000)


def test_slots_written_from_several_threads_each_with_its_staging_buffer(tmp_path):
    import threading

    from fate_edge.format.direct_write import Staging

    blobs = [os.urandom(5000 + 97 * i) for i in range(24)]
    slot = 2 * ALIGN
    with DirectFile(tmp_path / "f", buffer_bytes=ALIGN) as f:

        def writer(k: int) -> None:
            staging = Staging()
            for i in range(k, len(blobs), 3):
                f.pwrite_at(blobs[i], i * slot, staging)
            staging.close()

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert f.size == (len(blobs) - 1) * slot + len(blobs[-1])
    data = (tmp_path / "f").read_bytes()
    for i, b in enumerate(blobs):
        gap = data[i * slot + len(b) : (i + 1) * slot]  # zeros up to the next slot (the file ends at the last blob)
        assert data[i * slot : i * slot + len(b)] == b and gap == bytes(len(gap))


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    real_open, real_pwrite = os.open, os.pwrite

    def no_direct_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(dw.os, "open", no_direct_open)
    with DirectFile(tmp_path / "a") as f:
        f.write(b"abc" * 3000)
        assert not f.direct
    assert (tmp_path / "a").read_bytes() == b"abc" * 3000
    monkeypatch.setattr(dw.os, "open", real_open)

    refused = []

    def refusing_pwrite(fd, data, offset):  # open took O_DIRECT, the first write does not
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(dw.os, "pwrite", refusing_pwrite)
    with DirectFile(tmp_path / "b") as f:
        f.pwrite_at(b"xyz" * 2000, ALIGN)
        f.truncate(3 * ALIGN)
        assert not f.direct and refused == [ALIGN]
    data = (tmp_path / "b").read_bytes()
    assert data[ALIGN : ALIGN + 6000] == b"xyz" * 2000 and len(data) == 3 * ALIGN


def test_convert_writes_experts_and_resident_weights_directly(tmp_path, bundled_dir, monkeypatch):
    opened = []
    real_init = DirectFile.__init__

    def spy(self, path, *args, **kwargs):
        real_init(self, path, *args, **kwargs)
        opened.append((os.path.basename(path), self.direct))

    monkeypatch.setattr(DirectFile, "__init__", spy)
    convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    direct = _fs_takes_o_direct(tmp_path)
    assert sorted(opened) == [
        ("experts-16.bin", direct),
        ("experts-2.bin", direct),
        ("experts-4.bin", direct),
        ("resident.safetensors", direct),
    ]
