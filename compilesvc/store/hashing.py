"""Streaming sha256: copying while hashing, and files that appear only once their bytes are verified.

Every download in compilesvc (a blob from either store, a pinned model from S3 or a file, …) goes through
:func:`verified_file`: bytes stream into a temp file beside the destination while they are hashed, and the
destination appears (one atomic rename) only if the size and sha256 are the expected ones. Memory stays
at one chunk whatever the size.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from compilesvc.store.base import BlobTooLarge, IntegrityError

__all__ = ["CHUNK_SIZE", "HashedCopy", "HashingWriter", "SinkWriteError", "copy_hashing", "verified_file"]

CHUNK_SIZE = 1024 * 1024


class SinkWriteError(Exception):
    """Raised by :func:`copy_hashing` when writing failed (our side), as opposed to reading the source."""

    def __init__(self, cause: OSError):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class HashedCopy:
    """What :func:`copy_hashing` saw: the full sha256, the size, and optionally per-part sha256 digests."""

    sha256: str
    size: int
    part_digests: list[bytes] = field(default_factory=list)


def copy_hashing(
    read: Callable[[int], bytes],
    write: Callable[[bytes], object] | None,
    *,
    max_bytes: int | None = None,
    part_size: int | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> HashedCopy:
    """Copy ``read`` to ``write`` chunk by chunk, hashing on the way; memory stays at one chunk.

    ``max_bytes`` raises :class:`BlobTooLarge` as soon as it is exceeded (the caller removes what was
    written). ``part_size`` additionally records the sha256 of every ``part_size`` slice, which is what
    S3 combines into a multipart object's composite checksum. Errors raised by ``write`` come out
    wrapped in :class:`SinkWriteError` so callers can tell a failing store from a failing source.
    """
    full = hashlib.sha256()
    part = hashlib.sha256() if part_size else None
    part_fill = 0
    parts: list[bytes] = []
    size = 0
    while chunk := read(chunk_size):
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise BlobTooLarge(max_bytes)
        full.update(chunk)
        if part is not None and part_size:
            view = memoryview(chunk)
            while view:
                take = min(len(view), part_size - part_fill)
                part.update(view[:take])
                part_fill += take
                view = view[take:]
                if part_fill == part_size:
                    parts.append(part.digest())
                    part, part_fill = hashlib.sha256(), 0
        if write is not None:
            try:
                write(chunk)
            except OSError as exc:
                raise SinkWriteError(exc) from exc
    if part is not None and part_fill:
        parts.append(part.digest())
    return HashedCopy(full.hexdigest(), size, parts)


class HashingWriter:
    """A write-only sink that hashes what passes through it.

    Deliberately without seek/tell: s3transfer then treats it as non-seekable and writes the parts in
    order (holding early arrivals in a bounded window), which is what lets us hash while downloading.
    """

    def __init__(self, sink: BinaryIO):
        self._sink = sink
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.size += len(data)
        self._sink.write(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


@contextmanager
def verified_file(dest: Path, sha256: str, size: int | None = None, *, what: str) -> Iterator[HashingWriter]:
    """Yield a writer into a temp file beside ``dest``; on a clean exit the file becomes ``dest`` if it holds
    ``size`` bytes (when given) hashing to ``sha256``, else :class:`IntegrityError` naming ``what``.

    The temp file is removed whatever happens, so a failed or interrupted download leaves nothing at
    ``dest``. A write that fails inside :func:`copy_hashing` surfaces as the disk's own ``OSError``.
    """
    dest = Path(dest)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    temp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            writer = HashingWriter(out)
            try:
                yield writer
            except SinkWriteError as exc:
                raise exc.cause from None  # our disk failed, not the source
        if (size is not None and writer.size != size) or writer.hexdigest() != sha256:
            expected = f"{sha256} ({size} bytes)" if size is not None else sha256
            raise IntegrityError(f"{what} hashes to {writer.hexdigest()} ({writer.size} bytes), expected {expected}")
        os.replace(temp, dest)
    finally:
        temp.unlink(missing_ok=True)
