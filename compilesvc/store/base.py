"""The artifact store interface: content-addressed blobs plus create-only documents.

Blobs (compiled files, logs, uploaded models) live under ``blobs/sha256/<aa>/<hex>`` and are named by
their content, so writing one twice is harmless. Documents (bucket and artifact manifests) are written
create-only: an existing document is never overwritten, and a writer that loses the race is told so.
Manifests are written after every blob they name, so a visible manifest is always complete.

Two implementations pass one conformance suite: :class:`compilesvc.store.local.LocalStore` (a
directory, with HMAC-signed download URLs the API serves) and :class:`compilesvc.store.s3.S3Store`
(boto3 managed transfers, presigned URLs).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import BinaryIO, Protocol, cast

SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")  # \Z: "$" would let a trailing newline through


class UrlSigner(Protocol):
    """What laying out download URLs needs of a store (:func:`compilesvc.lifecycle.artifacts.describe`)."""

    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str: ...


class StoreError(Exception):
    """Base class of store failures. Callers treat them as infrastructure errors (retryable)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or refuses our credentials."""


class BlobNotFound(StoreError):
    pass


class BlobTooLarge(StoreError):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"blob exceeds the limit of {limit} bytes")


class IntegrityError(StoreError):
    """Bytes read back do not hash to the name they were stored under."""


class ContentMismatch(Exception):
    """The bytes a writer delivered are not the ones it declared, so nothing was stored.

    Not a :class:`StoreError`: the store is fine and a retry of the same bytes fails the same way.
    """


class SizeMismatch(ContentMismatch):
    """The stream ended after ``received`` bytes where ``expected`` were declared (a cut-off upload)."""

    def __init__(self, expected: int, received: int):
        self.expected = expected
        self.received = received
        super().__init__(f"received {received} of {expected} bytes")


class DigestMismatch(ContentMismatch):
    """The bytes hash to ``actual`` where the writer declared ``expected`` (both sha256 hex)."""

    def __init__(self, expected: str, actual: str):
        self.expected = expected
        self.actual = actual
        super().__init__(f"the body's sha256 is {actual}, not the declared {expected}")


def check_expected(sha256: str, size: int, *, expected_size: int | None, expected_sha256: str | None) -> None:
    """Raise :class:`ContentMismatch` unless what was read (``sha256``, ``size``) is what was declared.

    Stores call this after hashing and before publishing, so a refused write never becomes visible.
    """
    if expected_size is not None and size != expected_size:
        raise SizeMismatch(expected_size, size)
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise DigestMismatch(expected_sha256, sha256)


def check_expected_args(expected_size: int | None, expected_sha256: str | None, max_bytes: int | None) -> None:
    """Refuse, before a byte is read, what no stream could satisfy: :class:`BlobTooLarge` for a declared
    size over ``max_bytes``, ValueError for a malformed expectation (a caller's bug)."""
    if max_bytes is not None and expected_size is not None and expected_size > max_bytes:
        raise BlobTooLarge(max_bytes)
    if expected_size is not None and expected_size < 0:
        raise ValueError(f"expected_size must not be negative: {expected_size}")
    if expected_sha256 is not None and not SHA256_RE.match(expected_sha256):
        raise ValueError(f"expected_sha256 is not a lowercase sha256 hex digest: {expected_sha256!r}")


@dataclass(frozen=True)
class BlobInfo:
    sha256: str
    size: int
    created: bool  # False when identical content was already stored


@dataclass(frozen=True)
class StoredBlob:
    """A blob as a listing sees it (retention's sweep decides by these)."""

    sha256: str
    size: int
    modified: datetime


BLOB_PREFIX = "blobs/sha256/"


def blob_name(sha256: str) -> str:
    if not SHA256_RE.match(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


def artifact_manifest_name(key: str) -> str:
    return f"artifacts/{key}/manifest.json"


def artifact_signature_name(key: str) -> str:
    """The artifact manifest's signature (a model-signing bundle, :mod:`compilesvc.signing.artifacts`)."""
    return f"artifacts/{key}/model.sig"


def artifact_provenance_name(key: str) -> str:
    """The artifact's signed SLSA provenance (:mod:`compilesvc.signing.artifacts`)."""
    return f"artifacts/{key}/provenance.json"


def bucket_manifest_name(key: str) -> str:
    return f"buckets/{key}/manifest.json"


class ArtifactStore(abc.ABC):
    """Where blobs and manifests live. Every method streams; none holds a whole blob in memory."""

    url: str

    @abc.abstractmethod
    def put_file(self, path: Path) -> BlobInfo:
        """Store a file's bytes as a blob (hashing it while reading), unless that content exists."""

    def put_stream(
        self,
        stream: BinaryIO,
        *,
        max_bytes: int | None = None,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> BlobInfo:
        """Store a stream as a blob, hashing while reading; all or nothing.

        :class:`BlobTooLarge` past ``max_bytes``. When the stream ends, its size and sha256 are checked
        against ``expected_size`` / ``expected_sha256`` (when given) *before* anything is published:
        :class:`SizeMismatch` or :class:`DigestMismatch` leave no blob, temp file or open upload behind.
        An exception raised by ``stream.read`` (a client hanging up mid-body) propagates unchanged, with
        the same guarantee.
        """
        check_expected_args(expected_size, expected_sha256, max_bytes)
        return self._put_stream(stream, max_bytes, expected_size, expected_sha256)

    @abc.abstractmethod
    def _put_stream(self, stream: BinaryIO, max_bytes: int | None, expected_size: int | None,
                    expected_sha256: str | None) -> BlobInfo:
        """:meth:`put_stream` with its arguments checked: read, hash, call :func:`check_expected`, publish."""

    @abc.abstractmethod
    def blob_size(self, sha256: str) -> int | None:
        """The stored size of a blob, or None when it does not exist."""

    def has_blob(self, sha256: str) -> bool:
        return self.blob_size(sha256) is not None

    @abc.abstractmethod
    def open_blob(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        """A streaming reader of a blob; :class:`BlobNotFound` if absent."""

    @abc.abstractmethod
    def read_blob_range(self, sha256: str, offset: int, length: int) -> bytes:
        """``length`` bytes of a blob from ``offset`` (fewer at its end); :class:`BlobNotFound` if absent."""

    def open_blob_ranged(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        """A seekable reader of a blob that reads only what is read of it, by :meth:`read_blob_range` (a reader
        seeking past most of the blob costs what it reads); :class:`BlobNotFound` if absent."""
        size = self.blob_size(sha256)
        if size is None:
            raise BlobNotFound(f"blob {sha256} not found")
        from compilesvc.store.ranged import open_ranged

        return cast(AbstractContextManager[BinaryIO],
                    open_ranged(lambda offset, length: self.read_blob_range(sha256, offset, length), size))

    def iter_blob(self, sha256: str, chunk_size: int = 1024 * 1024) -> Iterator[bytes]:
        with self.open_blob(sha256) as reader:
            while chunk := reader.read(chunk_size):
                yield chunk

    @abc.abstractmethod
    def download_blob(self, sha256: str, dest: Path) -> None:
        """Copy a blob to ``dest``, verifying its sha256 (:class:`IntegrityError` on mismatch)."""

    @abc.abstractmethod
    def create_document(self, name: str, data: bytes) -> bool:
        """Write a small document if ``name`` does not exist. True if written, False if it already was."""

    @abc.abstractmethod
    def read_document(self, name: str) -> bytes | None:
        """A document's bytes, or None when it does not exist."""

    @abc.abstractmethod
    def document_location(self, name: str) -> str:
        """Where a document lives, as a URI (``s3://…`` or ``file://…``), for manifests and humans."""

    @abc.abstractmethod
    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str:
        """A download URL for a blob that stops working after ``expires_in`` seconds."""

    @abc.abstractmethod
    def sweep_incomplete_uploads(self, older_than: timedelta) -> int:
        """Remove writes this store began that were abandoned; returns how many were removed.

        A write is abandoned when nothing happened to it for ``older_than``: a multipart upload with
        no part uploaded since (S3), a temp file not written since (local). A process killed mid-write,
        or one whose own clean-up failed because the store was down, leaves these behind. Writes in
        progress are never touched as long as ``older_than`` exceeds the longest pause of a live
        write. Only the store's own writes are looked at (its prefix, its temp files).
        """

    @abc.abstractmethod
    def iter_blobs(self) -> Iterator[StoredBlob]:
        """Every stored blob, with its size and when it was written (in no particular order)."""

    @abc.abstractmethod
    def delete_blob(self, sha256: str) -> None:
        """Remove a blob; nothing happens if it is not there. Only retention deletes
        (:mod:`compilesvc.lifecycle.retention`)."""

    @abc.abstractmethod
    def delete_document(self, name: str) -> None:
        """Remove a document; nothing happens if it is not there. A document deleted may be created again."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise :class:`StoreUnavailable` unless the store answers (readiness probe)."""
