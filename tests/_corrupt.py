"""Damage a file in place, as a bad sector or a bit flip on the medium would."""


def flip_byte(path, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` of ``path`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
