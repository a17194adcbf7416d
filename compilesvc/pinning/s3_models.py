"""Models kept in S3: pinning ``s3://bucket/key`` to one object version (or ETag and size) with its sha256,
remembered in the ledger's ``model_pins`` so a popular model is read once, and streaming exactly the
pinned bytes again on the worker. Prefixes and "directory" objects are refused: they are not one object. An
object too large to hash inside a request is hashed in the background (:mod:`compilesvc.pinning.hash_jobs`).
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ModelPin
from compilesvc.ledger.sql import insert_ignore_duplicate
from compilesvc.pinning.pins import ModelChangedError, ModelRefError, PinnedModel
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store.hashing import copy_hashing, verified_file
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

    from compilesvc.pinning.hash_jobs import HashJobs

_PIN_ATTEMPTS = 3
_DIRECTORY_CONTENT_TYPES = frozenset({"application/x-directory", "httpd/unix-directory"})


class ObjectChanged(Exception):
    """The object changed between HEAD and GET while pinning (retry the pin), or is gone when fetched."""


_Changed = ObjectChanged


def parse_s3_uri(uri: str) -> tuple[str, str]:
    # Not urlsplit: S3 keys in s3:// URIs are not percent-encoded and may contain "?" or "#".
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket or not key:
        raise ModelRefError("expected s3://bucket/key")
    return bucket, key


class S3Models:
    """Pins and fetches ``s3://`` models. ``sessions`` (the ledger) remembers pins across processes (None:
    compute, do not remember); ``s3_client`` defaults to one built from the settings with the standard
    credential chain, on first use."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session] | None, *,
                 s3_client: S3Client | None = None):
        self.settings = settings
        self.sessions = sessions
        self._s3_client = s3_client
        self._lock = threading.Lock()
        self._hash_jobs: HashJobs | None = None

    @property
    def s3_client(self) -> S3Client:
        with self._lock:
            if self._s3_client is None:
                self._s3_client = make_client(self.settings.s3_endpoint_url, self.settings.s3_region)
            return self._s3_client

    def pin(self, ref: ModelRef) -> PinnedModel:
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
            try:
                # S3's own full-object SHA-256 (verified by S3 at upload) spares reading the object at all.
                sha256 = full_object_sha256(head) or self.object_sha256(bucket, key, version_id, etag, size)
            except _Changed:
                continue  # overwritten between HEAD and GET: pin the new content instead
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
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "ChecksumMode": "ENABLED"}
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

    @property
    def hash_jobs(self) -> HashJobs:
        with self._lock:
            if self._hash_jobs is None:
                from compilesvc.pinning.hash_jobs import HashJobs

                assert self.sessions is not None
                self._hash_jobs = HashJobs(self, self.sessions, self.settings.pin_hash_lease_seconds)
            return self._hash_jobs

    def object_sha256(self, bucket: str, key: str, version_id: str | None, etag: str, size: int) -> str:
        """The object's sha256: remembered from an earlier pin, else hashed here, or (larger than
        ``pin_inline_hash_max_mb``, with a ledger) by a background job (:mod:`compilesvc.pinning.hash_jobs`):
        :class:`ModelPinning` until it is done. :class:`ObjectChanged` when the bytes read are not the object's."""
        uri = f"s3://{bucket}/{key}"
        sha256 = self.remembered_pin(uri, version_id, etag, size)
        if sha256 is not None:
            return sha256
        if self.sessions is not None and size > self.settings.pin_inline_hash_max_mb * 1024**2:
            from compilesvc.pinning.hash_jobs import ObjectVersion, Progress, pinning

            found = self.hash_jobs.sha256(ObjectVersion(bucket, key, version_id, etag, size))
            if isinstance(found, Progress):
                raise pinning(uri, [found])
            return found
        sha256 = self.hash_object(bucket, key, version_id, etag, size)
        self.remember_pin(uri, version_id, etag, size, sha256)
        return sha256

    def hash_object(self, bucket: str, key: str, version_id: str | None, etag: str, size: int) -> str:
        copied = self.stream(bucket, key, version_id, etag, size, sink=None)
        if copied[1] != size:
            raise _Changed()
        return copied[0]

    def stream(
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

    def remembered_pin(self, uri: str, version_id: str | None, etag: str, size: int) -> str | None:
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

    def remember_pin(self, uri: str, version_id: str | None, etag: str, size: int, sha256: str) -> None:
        if self.sessions is None:
            return
        values = {"uri": uri, "version_id": version_id or "", "etag": etag, "size": size, "sha256": sha256}
        with transaction(self.sessions) as session:
            # A concurrent pin of the same object computed the same sha256: either row will do.
            insert_ignore_duplicate(session, ModelPin, values, ["uri", "version_id", "etag", "size"])

    def fetch(self, fetch: dict[str, Any], sha256: str, dest: Path) -> None:
        bucket, key, etag, size = str(fetch["bucket"]), str(fetch["key"]), str(fetch["etag"]), int(fetch["size"])
        version_id = fetch.get("version_id")

        with verified_file(dest, sha256, size, what="the model's bytes") as writer:
            try:
                self.stream(bucket, key, version_id, etag, size, sink=writer.write)
            except _Changed:
                which = f"version {version_id}" if version_id else f"ETag {etag}"
                raise ModelChangedError(
                    f"s3://{bucket}/{key} changed since it was pinned ({which} is gone); "
                    "resubmit the build to pin the current object"
                ) from None


def full_object_sha256(head: dict[str, Any]) -> str | None:
    """The object's SHA-256 when S3 holds a full-object one (a HEAD with ChecksumMode ENABLED); a multipart
    upload's is a checksum of part checksums, ``<base64>-<parts>``, and says nothing of the bytes."""
    value = head.get("ChecksumSHA256")
    if not isinstance(value, str) or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None
