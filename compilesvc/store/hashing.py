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

from compilesvc.store.base import BlobTooLarge, IntegrityError, SizeMismatch, check_expected

__all__ = ["CHUNK_SIZE", "HashedCopy", "HashingWriter", "SinkWriteError", "StreamHash", "VerifyingReader",
           "copy_hashing", "verified_file"]

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


class StreamHash:
    """The sha256 of a stream fed chunk by chunk, and optionally of every ``part_size`` slice of it (what S3
    combines into a multipart object's composite checksum); :class:`BlobTooLarge` past ``max_bytes``."""

    def __init__(self, *, part_size: int | None = None, max_bytes: int | None = None):
        self._full = hashlib.sha256()
        self._part = hashlib.sha256() if part_size else None
        self._part_size = part_size or 0
        self._part_fill = 0
        self._parts: list[bytes] = []
        self._max_bytes = max_bytes
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._max_bytes is not None and self.size > self._max_bytes:
            raise BlobTooLarge(self._max_bytes)
        self._full.update(chunk)
        if self._part is None:
            return
        view = memoryview(chunk)
        while view:
            take = min(len(view), self._part_size - self._part_fill)
            self._part.update(view[:take])
            self._part_fill += take
            view = view[take:]
            if self._part_fill == self._part_size:
                self._parts.append(self._part.digest())
                self._part, self._part_fill = hashlib.sha256(), 0

    def result(self) -> HashedCopy:
        parts = [*self._parts, self._part.digest()] if self._part is not None and self._part_fill else self._parts
        return HashedCopy(self._full.hexdigest(), self.size, list(parts))


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
    hashed = StreamHash(part_size=part_size, max_bytes=max_bytes)
    while chunk := read(chunk_size):
        hashed.update(chunk)
        if write is not None:
            try:
                write(chunk)
            except OSError as exc:
                raise SinkWriteError(exc) from exc
    return hashed.result()


class VerifyingReader:
    """A read-only stream over ``read`` that hashes what passes and, at the declared end, checks it: the
    chunk holding the last of ``expected_size`` bytes is returned only if everything read hashes to
    ``expected_sha256``, else :class:`DigestMismatch`; a stream that ends early or runs long raises
    :class:`SizeMismatch`. A consumer that pulls (s3transfer's upload of a non-seekable stream) thus sends
    its last part, or its single PUT, only for the declared content, and a failed read fails the transfer
    (s3transfer aborts the multipart upload), so nothing is published.

    Each ``read(n)`` returns ``n`` bytes until the end: s3transfer takes a short read for a part, and S3
    refuses parts under 5 MiB but the last. Deliberately without seek/tell. :attr:`verified` once the end was
    read and checked. (A size limit is the caller's to check against ``expected_size`` first: no more is
    ever read.)"""

    def __init__(self, read: Callable[[int], bytes], *, expected_size: int, expected_sha256: str):
        self._read = read
        self._expected_size = expected_size
        self._expected_sha256 = expected_sha256
        self._hash = StreamHash()
        self.verified = False

    def read(self, size: int = -1) -> bytes:
        remaining = self._expected_size - self._hash.size
        want = remaining if size < 0 else min(size, remaining)
        chunks: list[bytes] = []
        got = 0
        while got < want:
            chunk = self._read(min(want - got, CHUNK_SIZE))
            if not chunk:
                raise SizeMismatch(self._expected_size, self._hash.size + got)
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
        if data:
            self._hash.update(data)
        if self._hash.size == self._expected_size and not self.verified:
            if self._read(1):  # more than declared
                raise SizeMismatch(self._expected_size, self._hash.size + 1)
            copied = self._hash.result()
            check_expected(copied.sha256, copied.size, expected_size=self._expected_size,
                           expected_sha256=self._expected_sha256)
            self.verified = True
        return data


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
