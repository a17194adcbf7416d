"""S3Store: the artifact store in an S3 bucket (AWS or any S3-compatible server), via boto3 managed transfers.

Guarantees, and how they are met:

- **Bounded memory.** Blobs are hashed while they stream (1 MiB at a time). ``put_stream`` of a stream
  whose size and sha256 are declared uploads it as it arrives (a window of parts in memory); otherwise
  it spools to a temp file on local disk, then uploads that file. Uploads and downloads go through
  s3transfer, never through a whole-object ``bytes``.
- **Integrity.** A single-part upload carries the full-object ``ChecksumSHA256`` we computed, so the server
  refuses bytes that differ from what we hashed (400 BadDigest). Multipart uploads carry a SHA-256 per part
  (``ChecksumAlgorithm="SHA256"``); afterwards the composite checksum the server reports is compared with
  the one computed from our own pass over the bytes. Downloads are re-hashed (:class:`IntegrityError`).
- **Create-only.** A HEAD skips blobs that already exist. Every PutObject and CompleteMultipartUpload under
  this store's prefix carries ``If-None-Match: *`` so nothing is ever overwritten; s3transfer refuses that
  argument in ExtraArgs, so it is added by ``before-parameter-build`` event handlers on the write client
  (:func:`install_create_only`). 412 means the content is already there (``created=False``); 409
  (a concurrent conditional write in flight) is retried.
- **All or nothing.** ``put_stream`` checks the spooled bytes against the caller's ``expected_size`` /
  ``expected_sha256`` before any request reaches S3; a streamed upload sends its last part only once
  every byte matched, and is aborted otherwise. s3transfer aborts a multipart upload that fails;
  when that abort fails too (S3 down) or the process dies, :meth:`S3Store.sweep_incomplete_uploads`
  (:mod:`.s3_sweep`, run by the relay) aborts the leftover later.
- **Classified failures.** botocore connection, credential and 5xx errors become
  :class:`StoreUnavailable`, other S3 failures :class:`StoreError`, so callers can tell infrastructure
  failures from their own. :mod:`.s3_client` holds that classification, shared with :mod:`compilesvc.pinning.identity`.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from botocore.exceptions import (
    ClientError,
)
from s3transfer.utils import ChunksizeAdjuster

from compilesvc.store.base import (
    BLOB_PREFIX,
    SHA256_RE,
    ArtifactStore,
    BlobInfo,
    BlobNotFound,
    IntegrityError,
    StoredBlob,
    StoreError,
    StoreUnavailable,
    blob_name,
    check_expected,
)
from compilesvc.store.hashing import HashedCopy, SinkWriteError, VerifyingReader, copy_hashing, verified_file
from compilesvc.store.s3_client import (
    BOTO_ERRORS,
    TRANSFER_CHUNK,
    UPLOAD_WINDOW_PARTS,
    BodyReader,
    b64_digest,
    client_error_of,
    composite_sha256,
    http_status,
    install_create_only,
    is_conflict,
    is_not_found,
    is_precondition_failed,
    make_transfer_config,
    raise_store_error,
    s3_errors,
)
from compilesvc.store.s3_sweep import abort_abandoned_uploads
from compilesvc.store.signing import check_filename, content_disposition

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MAX_PRESIGN_SECONDS = 7 * 24 * 3600
_CONFLICT_RETRIES = 5


class S3Store(ArtifactStore):
    """Blobs under ``s3://bucket/prefix/blobs/sha256/…`` and create-only documents beside them.

    ``client`` serves reads, HEADs and presigning. ``create_client`` (default: ``client``) does the
    writes and gets the If-None-Match handlers for this store's prefix installed; :func:`open_store`
    passes a dedicated one. Clients should come from :func:`make_client` (SigV4 presigning).
    ``spool_dir`` holds ``put_stream`` spools (default: the system temp dir) and must have room for
    the largest upload.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        client: S3Client,
        *,
        create_client: S3Client | None = None,
        spool_dir: Path | None = None,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client
        self.create_client = create_client or client
        self.spool_dir = spool_dir
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._transfer = make_transfer_config()
        install_create_only(self.create_client, bucket, self.prefix)

    def _key(self, name: str) -> str:
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise ValueError(f"invalid object name {name!r}")
        return f"{self.prefix}/{name}" if self.prefix else name

    def _part_size(self, size: int) -> int | None:
        """The multipart part size s3transfer will use for ``size`` bytes, or None for a single PUT."""
        if size < self._transfer.multipart_threshold:
            return None
        return int(ChunksizeAdjuster().adjust_chunksize(self._transfer.multipart_chunksize, size))

    # -- blobs ---------------------------------------------------------------------------------------

    def _unless_missing(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, or None when S3 says the object is not there; other failures as StoreErrors."""
        try:
            return call()
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise_store_error(exc, what)
        except BOTO_ERRORS as exc:
            raise_store_error(exc, what)

    def _head(self, key: str, what: str, **extra: Any) -> dict[str, Any] | None:
        return cast(dict[str, Any] | None, self._unless_missing(
            what, lambda: self.client.head_object(Bucket=self.bucket, Key=key, **extra)))

    def blob_size(self, sha256: str) -> int | None:
        head = self._head(self._key(blob_name(sha256)), f"looking up blob {sha256}")
        return None if head is None else int(head["ContentLength"])

    def put_file(self, path: Path) -> BlobInfo:
        path = Path(path)
        before = path.stat()
        with open(path, "rb") as src:
            copied = copy_hashing(src.read, None, part_size=self._part_size(before.st_size))
        after = path.stat()
        unchanged = (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        if not unchanged or after.st_size != copied.size:
            raise IntegrityError(f"{path} changed while it was being stored")
        return self._store_file(path, copied)

    def _put_stream(self, stream: BinaryIO, max_bytes: int | None, expected_size: int | None,
                    expected_sha256: str | None) -> BlobInfo:
        if expected_size is not None and expected_sha256 is not None:
            # No more than expected_size is read, and put_stream refused one over max_bytes.
            return self._put_declared(stream, expected_size, expected_sha256)
        # Spool to local disk while hashing: the name (sha256) is only known once the last byte is read.
        with tempfile.NamedTemporaryFile(dir=self.spool_dir, prefix="compilesvc-spool-") as spool:
            try:
                copied = copy_hashing(stream.read, spool.write, max_bytes=max_bytes, part_size=TRANSFER_CHUNK)
                spool.flush()
            except SinkWriteError as exc:
                raise StoreError(f"cannot spool an upload to local disk: {exc.cause}") from exc.cause
            # Before any request to S3: a refused upload never starts a multipart upload.
            check_expected(copied.sha256, copied.size, expected_size=expected_size, expected_sha256=expected_sha256)
            part_size = self._part_size(copied.size)
            if part_size is not None and part_size != TRANSFER_CHUNK:
                # Past 10,000 parts s3transfer grows the part size; recompute the part digests to match.
                with open(spool.name, "rb") as again:
                    copied = copy_hashing(again.read, None, part_size=part_size)
            return self._store_file(Path(spool.name), copied)

    def _put_declared(self, stream: BinaryIO, size: int, sha256: str) -> BlobInfo:
        """A stream whose size and sha256 were declared: its name is known before the first byte, so it
        goes to S3 as it arrives (parts uploaded while later ones are still being received), with no spool.
        The :class:`VerifyingReader` lets the last part go only for the declared bytes; otherwise the
        multipart upload is aborted and nothing is published, as with a spool. When the blob is there
        already, the bytes are still read and checked: a client is told a blob is stored only once it has
        shown it holds its content."""
        key = self._key(blob_name(sha256))
        part_size = self._part_size(size)
        # No part digests of our own (a spooled upload compares them with S3's composite checksum): the bytes
        # hashed here are the very bytes handed to s3transfer, and S3 checks each part against the checksum
        # botocore computes from them.
        reader = VerifyingReader(stream.read, expected_size=size, expected_sha256=sha256)
        what = f"storing blob {sha256}"
        head = self._head(key, what)
        if head is not None:
            copy_hashing(reader.read, None)
            return self._existing(head, sha256, size)
        extra: dict[str, Any] = {"ContentType": "application/octet-stream"}
        if part_size is None:
            extra["ChecksumSHA256"] = b64_digest(bytes.fromhex(sha256))
        else:
            extra["ChecksumAlgorithm"] = "SHA256"
        # Parts of the size a seekable upload of ``size`` bytes would use (s3transfer cannot size the parts
        # of a stream itself), read ahead of the part uploads by a bounded window.
        config = copy.copy(self._transfer)
        config.multipart_chunksize = part_size or TRANSFER_CHUNK
        config.max_in_memory_upload_chunks = UPLOAD_WINDOW_PARTS
        try:
            self.create_client.upload_fileobj(cast(BinaryIO, reader), self.bucket, key, ExtraArgs=extra,
                                              Config=config)
        except BOTO_ERRORS as exc:
            client_error = client_error_of(exc)
            taken = client_error is not None and (is_precondition_failed(client_error) or is_conflict(client_error))
            if taken and reader.verified:
                # Someone else stored it meanwhile, or is completing it now; ours, all read, are the same bytes.
                return self._stored_by_another(key, sha256, size)
            raise_store_error(exc, what)
        if not reader.verified:  # s3transfer stopped reading before the declared end
            raise StoreError(f"{what}: the upload ended before the last byte was read")
        return BlobInfo(sha256, size, True)

    def _stored_by_another(self, key: str, sha256: str, size: int) -> BlobInfo:
        for attempt in range(_CONFLICT_RETRIES):
            head = self._head(key, f"storing blob {sha256}")
            if head is not None:
                return self._existing(head, sha256, size)
            time.sleep(0.1 * 2**attempt)
        raise StoreUnavailable(f"a concurrent upload of blob {sha256} did not complete")

    @staticmethod
    def _existing(head: dict[str, Any], sha256: str, size: int) -> BlobInfo:
        if int(head["ContentLength"]) != size:
            raise IntegrityError(f"blob {sha256} exists with {head['ContentLength']} bytes, expected {size}: "
                                 "the stored object is corrupt")
        return BlobInfo(sha256, size, False)

    def _store_file(self, path: Path, copied: HashedCopy) -> BlobInfo:
        sha256, size = copied.sha256, copied.size
        key = self._key(blob_name(sha256))
        part_size = self._part_size(size)
        extra: dict[str, Any] = {"ContentType": "application/octet-stream"}
        if part_size is None:
            # One PUT: the server checks the whole body against the digest of our own pass.
            extra["ChecksumSHA256"] = b64_digest(bytes.fromhex(sha256))
        else:
            extra["ChecksumAlgorithm"] = "SHA256"
        what = f"storing blob {sha256}"
        for attempt in range(_CONFLICT_RETRIES):
            head = self._head(key, what)
            if head is not None:
                return self._existing(head, sha256, size)
            try:
                self.create_client.upload_file(
                    str(path), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                )
            except BOTO_ERRORS as exc:
                client_error = client_error_of(exc)
                if client_error is not None and is_precondition_failed(client_error):
                    return BlobInfo(sha256, size, False)  # someone else stored it between HEAD and PUT
                if client_error is not None and is_conflict(client_error):
                    time.sleep(0.1 * 2**attempt)
                    continue
                raise_store_error(exc, what)
            if part_size is not None:
                self._verify_composite(key, sha256, copied)
            return BlobInfo(sha256, size, True)
        raise StoreUnavailable(f"concurrent uploads of blob {sha256} kept conflicting")

    def _verify_composite(self, key: str, sha256: str, copied: HashedCopy) -> None:
        """Tie the uploaded parts to the bytes we hashed: compare S3's composite checksum with ours."""
        head = self._head(key, f"verifying blob {sha256}", ChecksumMode="ENABLED")
        stored = None if head is None else head.get("ChecksumSHA256")
        if not stored:
            return  # the server does not report checksums; it still verified every part on upload
        expected = composite_sha256(copied.part_digests)
        if stored != expected:
            # What we just created is not the content its name promises: remove it before anyone reads it.
            with s3_errors(f"removing corrupt blob {sha256}"):
                self.client.delete_object(Bucket=self.bucket, Key=key)
            raise IntegrityError(
                f"blob {sha256}: the server's composite checksum {stored} differs from {expected}; "
                "the file changed during upload"
            )

    def open_blob(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        return self._open(sha256)

    @contextmanager
    def _open(self, sha256: str) -> Iterator[BinaryIO]:
        what = f"reading blob {sha256}"
        response = self._unless_missing(
            what, lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(blob_name(sha256))))
        if response is None:
            raise BlobNotFound(f"blob {sha256} not found")
        with BodyReader(response["Body"], what) as reader:
            yield cast(BinaryIO, reader)

    def read_blob_range(self, sha256: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"a range needs a non-negative offset and length, not {offset}, {length}")
        what = f"reading blob {sha256} at {offset}"
        key = self._key(blob_name(sha256))
        if length == 0:  # no such Range header: a HEAD says whether it exists
            if self._head(key, what) is None:
                raise BlobNotFound(f"blob {sha256} not found")
            return b""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key,
                                              Range=f"bytes={offset}-{offset + length - 1}")
        except ClientError as exc:
            if is_not_found(exc):
                raise BlobNotFound(f"blob {sha256} not found") from None
            if http_status(exc) == 416:  # the range starts at or past the end: nothing there
                return b""
            raise_store_error(exc, what)
        except BOTO_ERRORS as exc:
            raise_store_error(exc, what)
        if not response.get("ContentRange") or int(response.get("ContentLength", 0)) > length:
            # A server that ignored Range answers 200 with the whole blob: never read it (it may be huge), and
            # never take its first bytes for the range asked.
            response["Body"].close()
            raise StoreError(f"{what}: the store ignored the Range header (no ranged reads)")
        with BodyReader(response["Body"], what) as reader:
            return reader.read()

    def download_blob(self, sha256: str, dest: Path) -> None:
        key = self._key(blob_name(sha256))
        with verified_file(dest, sha256, what=f"blob {sha256} (the stored object is corrupt)") as writer:
            try:
                # cast: the stubs want IO, s3transfer needs only write() (and must not find seek()).
                self.client.download_fileobj(self.bucket, key, cast(BinaryIO, writer), Config=self._transfer)
            except BOTO_ERRORS as exc:
                client_error = client_error_of(exc)
                if client_error is not None and is_not_found(client_error):
                    raise BlobNotFound(f"blob {sha256} not found") from None
                raise_store_error(exc, f"downloading blob {sha256}")

    # -- documents -----------------------------------------------------------------------------------

    def create_document(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        content_type = "application/json" if name.endswith(".json") else "application/octet-stream"
        checksum = b64_digest(hashlib.sha256(data).digest())
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self.create_client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    IfNoneMatch="*",
                    ChecksumSHA256=checksum,
                    ContentType=content_type,
                )
                return True
            except ClientError as exc:
                if is_precondition_failed(exc):
                    return False
                if is_conflict(exc):
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise_store_error(exc, f"writing document {name}")
            except BOTO_ERRORS as exc:
                raise_store_error(exc, f"writing document {name}")
        raise StoreUnavailable(f"concurrent writes of document {name} kept conflicting")

    def read_document(self, name: str) -> bytes | None:
        what = f"reading document {name}"
        response = self._unless_missing(what, lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(name)))
        if response is None:
            return None
        with BodyReader(response["Body"], what) as reader:
            return reader.read()

    def document_location(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(name)}"

    # -- URLs and health -----------------------------------------------------------------------------

    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str:
        if not 0 < expires_in <= MAX_PRESIGN_SECONDS:
            raise ValueError(f"expires_in must be 1..{MAX_PRESIGN_SECONDS} seconds (the SigV4 limit)")
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(blob_name(sha256))}
        if filename is not None:
            params["ResponseContentDisposition"] = content_disposition(check_filename(filename))
        with s3_errors(f"presigning blob {sha256}"):
            return self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_in)

    def sweep_incomplete_uploads(self, older_than: timedelta) -> int:
        # Multipart uploads only ever target blobs (documents are single PUTs): look nowhere else.
        prefix = f"{self.prefix}/blobs/" if self.prefix else "blobs/"
        with s3_errors(f"sweeping abandoned uploads under {prefix}"):
            return abort_abandoned_uploads(self.create_client, self.bucket, prefix, older_than)

    def iter_blobs(self) -> Iterator[StoredBlob]:
        prefix = self._key(BLOB_PREFIX.rstrip("/")) + "/"
        with s3_errors(f"listing blobs under {prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    name = item["Key"].rsplit("/", 1)[-1]
                    if SHA256_RE.match(name):
                        yield StoredBlob(name, int(item["Size"]), item["LastModified"])

    def delete_blob(self, sha256: str) -> None:
        self._delete(self._key(blob_name(sha256)), f"deleting blob {sha256}")

    def delete_document(self, name: str) -> None:
        self._delete(self._key(name), f"deleting document {name}")

    def _delete(self, key: str, what: str) -> None:
        # DeleteObject succeeds for a key that is not there (S3's contract), which is what callers want.
        with s3_errors(what):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            # HEAD has no body, so a missing bucket is only a bare 404: say what it means.
            if http_status(exc) == 404:
                raise StoreUnavailable(f"S3 bucket {self.bucket!r} does not exist") from exc
            raise_store_error(exc, f"checking bucket {self.bucket}")
        except BOTO_ERRORS as exc:
            raise_store_error(exc, f"checking bucket {self.bucket}")


__all__ = ["S3Store"]
