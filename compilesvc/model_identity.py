"""Model identity: turning a spec's ``model.uri`` into immutable bytes with a known sha256, and fetching them.

The artifact key contains the model's content sha256, never its URI, so a URI must be *pinned* before a
key can be computed: :meth:`ModelResolver.pin` resolves it to exactly one immutable set of bytes and
describes how to fetch those bytes again (:attr:`PinnedModel.fetch`, JSON that travels to the worker).
:meth:`ModelResolver.fetch` on the worker downloads exactly those bytes and re-verifies the sha256.

- ``blob:sha256:<hex>``: an upload already in the artifact store; the name is the content.
- ``s3://bucket/key``: pinned to the object's version id when the bucket is versioned (or ``version_id``
  is given), else to its ETag + size. The sha256 is computed once by a streaming GET and remembered in
  the ``model_pins`` table, so a popular model is read from S3 once, not per build. Prefixes and
  "directory" objects are refused: they are not one immutable object.
- ``file:///abs/path``: only with ``settings.allow_file_models`` (embedded/dev); pinned to path, size and
  mtime, with the sha256 remembered in-process.

Client mistakes raise :class:`ModelRefError` (a ValueError naming the field); a model that changed after
pinning raises :class:`ModelChangedError`; store/S3 outages raise the store's ``StoreError`` family.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config import Settings
from compilesvc.db import transaction
from compilesvc.ledger.models import ModelPin
from compilesvc.ledger.sql import insert_ignore_duplicate
from compilesvc.spec import ModelRef
from compilesvc.store.base import SHA256_RE, ArtifactStore
from compilesvc.store.hashing import CHUNK_SIZE, copy_hashing, verified_file
from compilesvc.store.s3_client import (
    error_code,
    http_status,
    is_not_found,
    is_precondition_failed,
    make_client,
    raise_store_error,
    s3_errors,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

BLOB_PREFIX = "blob:sha256:"
_PIN_ATTEMPTS = 3
_FILE_CACHE_LIMIT = 4096
_DIRECTORY_CONTENT_TYPES = frozenset({"application/x-directory", "httpd/unix-directory"})


class ModelRefError(ValueError):
    """The spec's model reference cannot be used; ``field`` and ``message`` say why (a client error)."""

    def __init__(self, message: str, *, field: str = "model.uri"):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ModelChangedError(ModelRefError):
    """The model's bytes are no longer the ones that were pinned (overwritten or deleted)."""


@dataclass(frozen=True)
class PinnedModel:
    """A model pinned to immutable bytes. ``fetch`` is JSON: exactly which bytes to fetch, plus ``sha256``.

    ``fetch`` is one of ``{"kind": "blob", "sha256"}``,
    ``{"kind": "s3", "bucket", "key", "version_id" (or None), "etag", "size", "sha256"}`` or
    ``{"kind": "file", "path", "size", "mtime_ns", "sha256"}``.
    """

    uri: str
    format: str
    sha256: str
    size: int
    fetch: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PinnedModel:
        return cls(
            uri=str(data["uri"]),
            format=str(data["format"]),
            sha256=str(data["sha256"]),
            size=int(data["size"]),
            fetch=dict(data["fetch"]),
        )


class _Changed(Exception):
    """Internal: the object changed between HEAD and GET while pinning (retry the pin)."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    # Not urlsplit: S3 keys in s3:// URIs are not percent-encoded and may contain "?" or "#".
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket or not key:
        raise ModelRefError("expected s3://bucket/key")
    return bucket, key


def file_uri_path(uri: str) -> Path:
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise ModelRefError("expected file:///absolute/path")
    path = Path(urllib.request.url2pathname(parsed.path))
    if not path.is_absolute():
        raise ModelRefError("expected file:///absolute/path")
    return path


class ModelResolver:
    """Pins model references (API side) and fetches pinned models (worker side).

    ``store`` is needed for ``blob:`` models; ``sessions`` (the ledger) remembers S3 pins across processes
    (None: compute, do not remember). ``s3_client`` defaults to one built from the settings with the
    standard credential chain.
    """

    def __init__(
        self,
        settings: Settings,
        store: ArtifactStore | None,
        sessions: sessionmaker[Session] | None,
        *,
        s3_client: S3Client | None = None,
    ):
        self.settings = settings
        self.store = store
        self.sessions = sessions
        self._s3_client = s3_client
        self._file_hashes: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    @property
    def s3_client(self) -> S3Client:
        with self._lock:
            if self._s3_client is None:
                self._s3_client = make_client(self.settings.s3_endpoint_url, self.settings.s3_region)
            return self._s3_client

    # -- pinning -------------------------------------------------------------------------------------

    def pin(self, ref: ModelRef) -> PinnedModel:
        """Resolve ``ref`` to immutable bytes and their sha256 (:class:`ModelRefError` on client mistakes)."""
        if ref.uri.startswith(BLOB_PREFIX):
            return self._pin_blob(ref)
        if ref.uri.startswith("s3://"):
            return self._pin_s3(ref)
        if ref.uri.startswith("file://"):
            return self._pin_file(ref)
        raise ModelRefError('expected "blob:sha256:<hex>", "s3://bucket/key" or "file:///abs/path"')

    def _pin_blob(self, ref: ModelRef) -> PinnedModel:
        sha256 = ref.uri[len(BLOB_PREFIX) :]
        if not SHA256_RE.match(sha256):
            raise ModelRefError("expected blob:sha256:<64 lowercase hex digits>")
        if self.store is None:
            raise RuntimeError("ModelResolver needs an artifact store to pin blob: models")
        size = self.store.blob_size(sha256)
        if size is None:
            raise ModelRefError(f"blob sha256:{sha256} is not uploaded; POST /v1/models first")
        return PinnedModel(ref.uri, ref.format, sha256, size, {"kind": "blob", "sha256": sha256})

    def _pin_s3(self, ref: ModelRef) -> PinnedModel:
        bucket, key = parse_s3_uri(ref.uri)
        canonical = f"s3://{bucket}/{key}"
        if key.endswith("/"):
            raise ModelRefError(f"{canonical} names a prefix (a directory); upload a tar of the directory")
        for _ in range(_PIN_ATTEMPTS):
            head = self._head_model(bucket, key, ref.version_id)
            size = int(head["ContentLength"])
            if size == 0 and str(head.get("ContentType", "")).split(";")[0] in _DIRECTORY_CONTENT_TYPES:
                raise ModelRefError(f"{canonical} is a directory marker; upload a tar of the directory")
            etag = str(head["ETag"])
            # An object in a versioned bucket has a version id that never changes content; the version
            # "null" (versioning suspended) is overwritable, so the ETag is always pinned as well.
            version_id = head.get("VersionId") or ref.version_id
            sha256 = self._remembered_pin(canonical, version_id, etag, size)
            if sha256 is None:
                try:
                    sha256 = self._hash_s3(bucket, key, version_id, etag, size)
                except _Changed:
                    continue  # overwritten between HEAD and GET: pin the new content instead
                self._remember_pin(canonical, version_id, etag, size, sha256)
            fetch = {
                "kind": "s3",
                "bucket": bucket,
                "key": key,
                "version_id": version_id,
                "etag": etag,
                "size": size,
                "sha256": sha256,
            }
            return PinnedModel(ref.uri, ref.format, sha256, size, fetch)
        raise ModelChangedError(f"{canonical} kept changing while it was being read; retry once writes to it stop")

    def _head_model(self, bucket: str, key: str, version_id: str | None) -> dict[str, Any]:
        canonical = f"s3://{bucket}/{key}"
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id:
            kwargs["VersionId"] = version_id
        try:
            return dict(self.s3_client.head_object(**kwargs))
        except ClientError as exc:
            status = http_status(exc)
            if is_not_found(exc) or error_code(exc) == "NoSuchBucket":
                if version_id:
                    raise ModelRefError(
                        f"version {version_id} of {canonical} does not exist", field="model.version_id"
                    ) from None
                if self._is_prefix(bucket, key):
                    raise ModelRefError(
                        f"{canonical} is a prefix (a directory), not an object; upload a tar of the directory"
                    ) from None
                raise ModelRefError(f"{canonical} does not exist") from None
            if status == 403:
                raise ModelRefError(
                    f"access to {canonical} is denied (403); grant the service s3:GetObject on it"
                ) from None
            if status == 400 and version_id:
                raise ModelRefError(
                    f"S3 refused version id {version_id!r} for {canonical}", field="model.version_id"
                ) from None
            raise_store_error(exc, f"looking up model {canonical}")
        except Exception as exc:
            raise_store_error(exc, f"looking up model {canonical}")

    def _is_prefix(self, bucket: str, key: str) -> bool:
        try:
            listing = self.s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/", MaxKeys=1)
        except ClientError:
            return False  # no list permission (or no bucket): report plain "does not exist"
        except Exception as exc:
            raise_store_error(exc, f"listing s3://{bucket}/{key}/")
        return int(listing.get("KeyCount", 0)) > 0

    def _hash_s3(self, bucket: str, key: str, version_id: str | None, etag: str, size: int) -> str:
        copied = self._stream_s3(bucket, key, version_id, etag, size, sink=None)
        if copied[1] != size:
            raise _Changed()
        return copied[0]

    def _stream_s3(
        self,
        bucket: str,
        key: str,
        version_id: str | None,
        etag: str,
        size: int,
        sink: Callable[[bytes], object] | None,
    ) -> tuple[str, int]:
        """GET exactly the pinned object (IfMatch the ETag), hashing as it streams; returns (sha256, size)."""
        canonical = f"s3://{bucket}/{key}"
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "IfMatch": etag}
        if version_id:
            kwargs["VersionId"] = version_id
        try:
            response = self.s3_client.get_object(**kwargs)
        except ClientError as exc:
            if is_precondition_failed(exc) or is_not_found(exc):
                raise _Changed() from None
            if http_status(exc) == 403:
                raise ModelRefError(f"access to {canonical} is denied (403)") from None
            raise_store_error(exc, f"reading model {canonical}")
        except Exception as exc:
            raise_store_error(exc, f"reading model {canonical}")
        body = response["Body"]
        try:
            with s3_errors(f"reading model {canonical}"):
                copied = copy_hashing(body.read, sink)
        finally:
            body.close()
        return copied.sha256, copied.size

    def _remembered_pin(self, uri: str, version_id: str | None, etag: str, size: int) -> str | None:
        if self.sessions is None:
            return None
        with transaction(self.sessions) as session:
            return session.scalar(
                select(ModelPin.sha256).where(
                    ModelPin.uri == uri,
                    ModelPin.version_id == (version_id or ""),
                    ModelPin.etag == etag,
                    ModelPin.size == size,
                )
            )

    def _remember_pin(self, uri: str, version_id: str | None, etag: str, size: int, sha256: str) -> None:
        if self.sessions is None:
            return
        values = {"uri": uri, "version_id": version_id or "", "etag": etag, "size": size, "sha256": sha256}
        with transaction(self.sessions) as session:
            # A concurrent pin of the same object computed the same sha256: either row will do.
            insert_ignore_duplicate(session, ModelPin, values, ["uri", "version_id", "etag", "size"])

    def _pin_file(self, ref: ModelRef) -> PinnedModel:
        if not self.settings.allow_file_models:
            raise ModelRefError(
                "file:// models are disabled on this service (COMPILESVC_ALLOW_FILE_MODELS); "
                "upload the file with POST /v1/models or use s3://"
            )
        path = Path(os.path.realpath(file_uri_path(ref.uri)))
        for _ in range(_PIN_ATTEMPTS):
            before = self._stat_model_file(path)
            cache_key = (str(path), before.st_size, before.st_mtime_ns)
            sha256 = self._file_hashes.get(cache_key)
            if sha256 is None:
                with open(path, "rb") as src:
                    copied = copy_hashing(src.read, None)
                after = self._stat_model_file(path)
                if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or (
                    copied.size != before.st_size
                ):
                    continue  # written to while we read it: hash again
                sha256 = copied.sha256
                with self._lock:
                    if len(self._file_hashes) >= _FILE_CACHE_LIMIT:
                        self._file_hashes.pop(next(iter(self._file_hashes)))
                    self._file_hashes[cache_key] = sha256
            fetch = {
                "kind": "file",
                "path": str(path),
                "size": before.st_size,
                "mtime_ns": before.st_mtime_ns,
                "sha256": sha256,
            }
            return PinnedModel(ref.uri, ref.format, sha256, before.st_size, fetch)
        raise ModelChangedError(f"{path} kept changing while it was being read; retry once writes to it stop")

    @staticmethod
    def _stat_model_file(path: Path) -> os.stat_result:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ModelRefError(f"{path} does not exist") from None
        except OSError as exc:
            raise ModelRefError(f"cannot read {path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise ModelRefError(f"{path} is a directory; upload a tar of the directory")
        if not stat.S_ISREG(st.st_mode):
            raise ModelRefError(f"{path} is not a regular file")
        if not os.access(path, os.R_OK):
            raise ModelRefError(f"{path} is not readable (permissions)")
        return st

    # -- fetching (worker side) ----------------------------------------------------------------------

    def fetch(self, pinned_fetch: dict[str, Any], dest: Path) -> None:
        """Write exactly the pinned bytes to ``dest`` (atomically), verifying their sha256.

        :class:`ModelChangedError` when the source no longer holds them; :class:`IntegrityError` when
        bytes arrive that do not hash to the pinned sha256.
        """
        kind = pinned_fetch.get("kind")
        sha256 = str(pinned_fetch.get("sha256", ""))
        if not SHA256_RE.match(sha256):
            raise ValueError(f"pinned model fetch description lacks a sha256: {pinned_fetch!r}")
        dest = Path(dest)
        if kind == "blob":
            if self.store is None:
                raise RuntimeError("ModelResolver needs an artifact store to fetch blob: models")
            self.store.download_blob(sha256, dest)
        elif kind == "s3":
            self._fetch_s3(pinned_fetch, sha256, dest)
        elif kind == "file":
            self._fetch_file(pinned_fetch, sha256, dest)
        else:
            raise ValueError(f"unknown pinned model kind {kind!r}")

    def _fetch_s3(self, fetch: dict[str, Any], sha256: str, dest: Path) -> None:
        bucket, key, etag, size = str(fetch["bucket"]), str(fetch["key"]), str(fetch["etag"]), int(fetch["size"])
        version_id = fetch.get("version_id")

        with verified_file(dest, sha256, size, what="the model's bytes") as writer:
            try:
                self._stream_s3(bucket, key, version_id, etag, size, sink=writer.write)
            except _Changed:
                which = f"version {version_id}" if version_id else f"ETag {etag}"
                raise ModelChangedError(
                    f"s3://{bucket}/{key} changed since it was pinned ({which} is gone); "
                    "resubmit the build to pin the current object"
                ) from None

    def _fetch_file(self, fetch: dict[str, Any], sha256: str, dest: Path) -> None:
        path, size, mtime_ns = Path(str(fetch["path"])), int(fetch["size"]), int(fetch["mtime_ns"])
        changed = ModelChangedError(
            f"{path} changed since it was pinned (size or mtime differ); resubmit the build to pin it again"
        )
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise changed

        with verified_file(dest, sha256, size, what="the model's bytes") as writer, open(path, "rb") as src:
            shutil.copyfileobj(src, writer, CHUNK_SIZE)  # verified_file hashes what passes


def content_sha256_for_key(ref: ModelRef, settings: Settings) -> str:
    """The model sha256 that goes into a key, for the ``compilesvc key`` CLI (no ledger, no store).

    ``file://`` is accepted here whatever ``allow_file_models`` says: the CLI hashes a file on the
    user's own machine, and the setting exists to stop the *service* reading its host's files.
    """
    if ref.uri.startswith(BLOB_PREFIX):
        sha256 = ref.uri[len(BLOB_PREFIX) :]
        if not SHA256_RE.match(sha256):
            raise ModelRefError("expected blob:sha256:<64 lowercase hex digits>")
        return sha256
    if ref.uri.startswith("file://") and not settings.allow_file_models:
        settings = settings.model_copy(update={"allow_file_models": True})
    return ModelResolver(settings, None, None).pin(ref).sha256


__all__ = [
    "ModelChangedError",
    "ModelRefError",
    "ModelResolver",
    "PinnedModel",
    "content_sha256_for_key",
]
