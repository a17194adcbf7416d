"""Talking to S3 with boto3: the client and transfer settings, the If-None-Match handlers that make this
store's writes create-only, and the classification of boto/s3transfer failures into
:class:`~compilesvc.store.base.StoreError` (infrastructure) and its kinds.

:class:`compilesvc.store.s3.S3Store` is built on these; :mod:`compilesvc.pinning.identity` shares the error
classification for models kept in S3.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, cast

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

from compilesvc.store.base import StoreError, StoreUnavailable

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
#: Parts of a streamed upload (a declared blob arriving over HTTP) read ahead of the part uploads, in
#: memory: as many as upload at once, so the window bounds both memory (4 x 8 MiB) and concurrency.
UPLOAD_WINDOW_PARTS = 4

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


BOTO_ERRORS = (BotoCoreError, ClientError, S3UploadFailedError, RetriesExceededError)


@contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """Translate boto failures raised inside the block into StoreError/StoreUnavailable."""
    try:
        yield
    except BOTO_ERRORS as exc:
        raise_store_error(exc, what)


def b64_digest(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


# -- streaming helpers -------------------------------------------------------------------------------


class BodyReader:
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

    def __enter__(self) -> BodyReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def composite_sha256(part_digests: list[bytes]) -> str:
    """The checksum S3 reports for a multipart object uploaded with per-part SHA-256 checksums."""
    return f"{b64_digest(hashlib.sha256(b''.join(part_digests)).digest())}-{len(part_digests)}"
