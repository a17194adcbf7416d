"""A seekable reader of a blob that reads only the ranges asked for (each through a ranged read of the store), so
a reader that seeks past most of a blob (``tarfile`` in its seekable ``"r:"`` mode skipping member data) costs what
it reads, not the blob's size. Buffered: small reads (a 512-byte tar header) come out of one ranged read."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

#: Bytes fetched by one ranged read for small reads: a tar header and the small member after it, in one request.
RANGE_BUFFER = 64 * 1024


class RangedReader(io.RawIOBase):
    """``read_range(offset, length)`` over a blob of ``size`` bytes, as an unbuffered seekable file."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int):
        super().__init__()
        self._read_range = read_range
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        length = min(len(view), max(0, self._size - self._pos))
        if length == 0:
            return 0
        data = self._read_range(self._pos, length)
        if len(data) != length:
            raise OSError(f"a ranged read at {self._pos} returned {len(data)} of {length} bytes")
        view[:length] = data
        self._pos += length
        return length


def open_ranged(read_range: Callable[[int, int], bytes], size: int,
                buffer_size: int = RANGE_BUFFER) -> io.BufferedReader:
    return io.BufferedReader(RangedReader(read_range, size), buffer_size)
