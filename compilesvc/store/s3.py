"""S3Store: the artifact store in an S3 bucket (AWS or any S3-compatible server), via boto3 managed transfers.

Guarantees, and how they are met:

- **Bounded memory.** Blobs are hashed while they stream (1 MiB at a time); ``put_stream`` spools to a
  temp file on local disk, then uploads that file. Uploads and downloads go through s3transfer
  (``upload_file``/``download_fileobj``), never through a whole-object ``bytes``.
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
  ``expected_sha256`` before any request reaches S3. s3transfer aborts a multipart upload that fails;
  when that abort fails too (S3 down) or the process dies, :meth:`S3Store.sweep_incomplete_uploads`
  (:mod:`.s3_sweep`, run by the relay) aborts the leftover later.
- **Classified failures.** botocore connection, credential and 5xx errors become
  :class:`StoreUnavailable`, other S3 failures :class:`StoreError`, so callers can tell infrastructure
  failures from their own. :func:`store_error_for` is shared with :mod:`compilesvc.model_identity`.
"""

from __future__ import annotations

import base64
import hashlib
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn, cast

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
)
from s3transfer.exceptions import RetriesExceededError
from s3transfer.utils import ChunksizeAdjuster

from compilesvc.store.base import (
    ArtifactStore,
    BlobInfo,
    BlobNotFound,
    IntegrityError,
    StoreError,
    StoreUnavailable,
    blob_name,
    check_expected,
)
from compilesvc.store.hashing import HashedCopy, SinkWriteError, copy_hashing, verified_file
from compilesvc.store.s3_sweep import abort_abandoned_uploads
from compilesvc.store.signing import check_filename, content_disposition

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1024 * 1024
#: Multipart threshold and part size (the boto3 defaults, pinned so the composite checksum we compute
#: from our own pass uses the same part boundaries as the upload).
TRANSFER_CHUNK = 8 * MiB
TRANSFER_CONCURRENCY = 10
#: Download parts that may wait in memory for an earlier part (non-seekable, hashing writer). Measured
#: with bench/stream_memory.py on a 1 GiB blob: ~68 MB extra peak RSS at 4, ~47 MB at 2; s3transfer's
#: default of 10 would pass 100 MB. 4 keeps several ranged GETs in flight, which real S3 needs for speed.
DOWNLOAD_WINDOW_PARTS = 4
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
_CONFLICT_RETRIES = 5

# Error codes that mean "the store is misconfigured or not reachable", not "this request was wrong".
_UNAVAILABLE_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "NoSuchBucket",
        "RequestTimeTooSkewed",
        "RequestTimeout",
        "ServiceUnavailable",
        "SignatureDoesNotMatch",
        "SlowDown",
        "TokenRefreshRequired",
        "InternalError",
    }
)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchVersion"})


# -- clients -----------------------------------------------------------------------------------------


def make_client(
    endpoint_url: str | None, region: str, *, session: boto3.Session | None = None
) -> S3Client:
    """An S3 client with the standard credential chain (or ``session``'s), SigV4 and bounded timeouts.

    SigV4 is forced because botocore still presigns with SigV2 in some regions, which S3-compatible
    servers and ``response-content-disposition`` do not survive. A custom endpoint (MinIO, SeaweedFS,
    a local gateway) gets path-style addressing: such servers rarely have wildcard DNS for buckets.
    """
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"} if endpoint_url else {},
        # Standard mode retries throttling and connection errors with backoff; the attempt count is
        # left to AWS_MAX_ATTEMPTS / the AWS config file (default 3).
        retries={"mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        # One connection per transfer thread, plus headroom for HEADs running alongside.
        max_pool_connections=2 * TRANSFER_CONCURRENCY,
    )
    return (session or boto3.Session()).client(
        "s3", endpoint_url=endpoint_url, region_name=region, config=config
    )


def make_transfer_config() -> TransferConfig:
    config = TransferConfig(
        multipart_threshold=TRANSFER_CHUNK,
        multipart_chunksize=TRANSFER_CHUNK,
        max_concurrency=TRANSFER_CONCURRENCY,
        # The CRT client would bypass botocore's event system, and with it the If-None-Match handlers.
        preferred_transfer_client="classic",
    )
    # Not a TransferConfig argument in boto3, but an s3transfer setting it passes through: parts that
    # arrive ahead of the one the hashing writer needs wait in memory, at most this many.
    config.max_in_memory_download_chunks = DOWNLOAD_WINDOW_PARTS
    return config


def install_create_only(client: S3Client, bucket: str, prefix: str) -> None:
    """Make every PutObject/CompleteMultipartUpload to ``bucket``/``prefix`` carry ``If-None-Match: *``.

    Scoped to this store's keys so that a client shared with other code keeps its other writes intact;
    idempotent (re-installing replaces the handlers rather than stacking them).
    """
    key_prefix = f"{prefix}/" if prefix else ""

    def add_if_none_match(params: dict[str, Any], **_: Any) -> None:
        if params.get("Bucket") == bucket and str(params.get("Key", "")).startswith(key_prefix):
            params.setdefault("IfNoneMatch", "*")

    for operation in ("PutObject", "CompleteMultipartUpload"):
        client.meta.events.register(
            f"before-parameter-build.s3.{operation}",
            add_if_none_match,
            unique_id=f"compilesvc-create-only-{operation}-{bucket}/{key_prefix}",
        )


# -- error classification ----------------------------------------------------------------------------


def client_error_of(exc: BaseException | None) -> ClientError | None:
    """The S3 ClientError behind ``exc``: boto3 wraps upload failures, s3transfer download retries."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ClientError):
            return exc
        if isinstance(exc, RetriesExceededError):
            exc = exc.last_exception
            continue
        exc = exc.__cause__ or exc.__context__
    return None


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_not_found(exc: ClientError) -> bool:
    code = error_code(exc)
    return code in _NOT_FOUND_CODES or (http_status(exc) == 404 and code != "NoSuchBucket")


def is_precondition_failed(exc: ClientError) -> bool:
    return http_status(exc) == 412 or error_code(exc) == "PreconditionFailed"


def is_conflict(exc: ClientError) -> bool:
    # AWS answers 409 ConditionalRequestConflict when another conditional write to the key is in flight.
    return http_status(exc) == 409 or error_code(exc) == "ConditionalRequestConflict"


def store_error_for(exc: BaseException, what: str) -> StoreError | None:
    """Classify a boto/s3transfer failure while doing ``what``; None for programming errors (re-raise)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, ParamValidationError):
        return None
    if isinstance(
        exc, (ConnectionError, HTTPClientError, NoCredentialsError, PartialCredentialsError,
              CredentialRetrievalError, NoRegionError)
    ):
        return StoreUnavailable(f"S3 unavailable while {what}: {exc}")
    client_error = client_error_of(exc)
    if client_error is not None:
        code, status = error_code(client_error), http_status(client_error)
        detail = client_error.response.get("Error", {}).get("Message", "")
        message = f"S3 error while {what}: {code or status} {detail}"
        if code in _UNAVAILABLE_CODES or status >= 500 or status in (401, 403):
            return StoreUnavailable(message.strip())
        return StoreError(message.strip())
    if isinstance(exc, RetriesExceededError):
        return StoreUnavailable(f"S3 unavailable while {what}: {exc.last_exception}")
    if isinstance(exc, (BotoCoreError, S3UploadFailedError)):
        return StoreError(f"S3 error while {what}: {exc}")
    return None


def raise_store_error(exc: BaseException, what: str) -> NoReturn:
    mapped = store_error_for(exc, what)
    if mapped is None:
        raise exc
    if mapped is exc:
        raise exc
    raise mapped from exc


_BOTO_ERRORS = (BotoCoreError, ClientError, S3UploadFailedError, RetriesExceededError)


@contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """Translate boto failures raised inside the block into StoreError/StoreUnavailable."""
    try:
        yield
    except _BOTO_ERRORS as exc:
        raise_store_error(exc, what)


def b64_digest(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


# -- streaming helpers -------------------------------------------------------------------------------


class _BodyReader:
    """A streaming GetObject body whose network failures surface as StoreUnavailable."""

    def __init__(self, body: Any, what: str):
        self._body = body
        self._what = what

    def read(self, size: int = -1) -> bytes:
        with s3_errors(self._what):
            try:
                return cast(bytes, self._body.read(size if size >= 0 else None))
            except OSError as exc:  # urllib3 protocol errors surface as OSError subclasses
                raise StoreUnavailable(f"S3 connection lost while {self._what}: {exc}") from exc

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> _BodyReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def composite_sha256(part_digests: list[bytes]) -> str:
    """The checksum S3 reports for a multipart object uploaded with per-part SHA-256 checksums."""
    return f"{b64_digest(hashlib.sha256(b''.join(part_digests)).digest())}-{len(part_digests)}"


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

    def _head(self, key: str, what: str, **extra: Any) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.client.head_object(Bucket=self.bucket, Key=key, **extra))
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise_store_error(exc, what)
        except _BOTO_ERRORS as exc:
            raise_store_error(exc, what)

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
        # Spool to local disk while hashing: the upload needs a seekable source for parallel parts and
        # retries, and the name (sha256) is only known once the last byte is read.
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
                if int(head["ContentLength"]) != size:
                    raise IntegrityError(
                        f"blob {sha256} exists with {head['ContentLength']} bytes, expected {size}: "
                        "the stored object is corrupt"
                    )
                return BlobInfo(sha256, size, False)
            try:
                self.create_client.upload_file(
                    str(path), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                )
            except _BOTO_ERRORS as exc:
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
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(blob_name(sha256)))
        except ClientError as exc:
            if is_not_found(exc):
                raise BlobNotFound(f"blob {sha256} not found") from None
            raise_store_error(exc, what)
        except _BOTO_ERRORS as exc:
            raise_store_error(exc, what)
        with _BodyReader(response["Body"], what) as reader:
            yield cast(BinaryIO, reader)

    def download_blob(self, sha256: str, dest: Path) -> None:
        key = self._key(blob_name(sha256))
        with verified_file(dest, sha256, what=f"blob {sha256} (the stored object is corrupt)") as writer:
            try:
                # cast: the stubs want IO, s3transfer needs only write() (and must not find seek()).
                self.client.download_fileobj(self.bucket, key, cast(BinaryIO, writer), Config=self._transfer)
            except _BOTO_ERRORS as exc:
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
            except _BOTO_ERRORS as exc:
                raise_store_error(exc, f"writing document {name}")
        raise StoreUnavailable(f"concurrent writes of document {name} kept conflicting")

    def read_document(self, name: str) -> bytes | None:
        what = f"reading document {name}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise_store_error(exc, what)
        except _BOTO_ERRORS as exc:
            raise_store_error(exc, what)
        with _BodyReader(response["Body"], what) as reader:
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

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            # HEAD has no body, so a missing bucket is only a bare 404: say what it means.
            if http_status(exc) == 404:
                raise StoreUnavailable(f"S3 bucket {self.bucket!r} does not exist") from exc
            raise_store_error(exc, f"checking bucket {self.bucket}")
        except _BOTO_ERRORS as exc:
            raise_store_error(exc, f"checking bucket {self.bucket}")


__all__ = [
    "S3Store",
    "client_error_of",
    "composite_sha256",
    "install_create_only",
    "make_client",
    "make_transfer_config",
    "s3_errors",
    "store_error_for",
]
