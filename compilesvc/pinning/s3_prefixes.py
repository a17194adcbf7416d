"""Checkpoint directories kept in S3 (``s3://bucket/prefix/``): every object under the prefix pinned at submit by
its version id (or its ETag and size in an unversioned bucket), config.json read by that version, and on the
worker each object fetched again by its pin and verified.

What a pin costs: one paginated ListObjectVersions pass (every object's key, version id, ETag and size), and the
GETs of config.json and the weight index only when the ledger has not remembered reading those very versions
(:mod:`compilesvc.pinning.prefix_reads`). An object is HEADed only for its S3 checksum, when the weight digests are
needed; a bucket that denies ListBucketVersions is listed with ListObjectsV2 and every object HEADed instead.

Weight digests (only for a compile that writes pre-sharded weights) come from the object's full-object SHA-256
checksum when S3 has one, else from the ledger's remembered pins (``model_pins``), else from hashing the object
as it streams (and remembering it): in the request for a small one, in the background for a large one
(:mod:`compilesvc.pinning.hash_jobs`; the pin answers :class:`ModelPinning` until every such file is hashed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from compilesvc.pinning import prefix_reads
from compilesvc.pinning.checkpoints import (
    _SMALL_LIMITS,
    check_total_size,
    listing_sha256,
    material_of,
    safe_relative,
    verify_digests,
)
from compilesvc.pinning.hash_jobs import Progress, pinning
from compilesvc.pinning.pins import ModelChangedError, ModelPinning, ModelRefError, PinnedModel
from compilesvc.pinning.s3_models import ObjectChanged, full_object_sha256, parse_s3_uri
from compilesvc.spec.checkpoint import CONFIG_MAX_BYTES, WEIGHT_LAYOUTS
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store.s3_client import error_code, http_status, is_not_found, raise_store_error

if TYPE_CHECKING:
    from compilesvc.pinning.s3_models import S3Models


def _denied_or_missing(exc: ClientError, what: str) -> ModelRefError | None:
    if error_code(exc) == "NoSuchBucket" or is_not_found(exc):
        return ModelRefError(f"{what} does not exist")
    if http_status(exc) == 403:
        return ModelRefError(f"access to {what} is denied (403); grant the service s3:ListBucket and s3:GetObject "
                             "on it")
    return None


def _latest_versions(s3: S3Models, bucket: str, prefix: str, max_files: int) -> list[dict[str, Any]] | None:
    """Every current object under ``prefix`` with its version id (None in an unversioned bucket), ETag and size, in
    one paginated ListObjectVersions pass: no request per object. None when the bucket denies
    ListBucketVersions (a policy granting s3:ListBucket alone) or the server has no such call."""

    def latest(page: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # Delete markers are a separate list (DeleteMarkers): a deleted key has no latest version here.
        for item in page.get("Versions", []):
            if item.get("IsLatest"):
                yield {"key": str(item["Key"]), "version_id": _version_id(item.get("VersionId")),
                       "etag": str(item["ETag"]), "size": int(item.get("Size", 0))}

    try:
        return _listing(s3, "list_object_versions", bucket, prefix, max_files, latest, versions=True)
    except _VersionsDenied:
        return None


def _list(s3: S3Models, bucket: str, prefix: str, max_files: int) -> list[str]:
    """The keys under ``prefix`` by ListObjectsV2 (no version ids: each object is HEADed after)."""

    def contents(page: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for item in page.get("Contents", []):
            yield {"key": str(item["Key"]), "size": int(item.get("Size", 0))}

    return [str(item["key"]) for item in _listing(s3, "list_objects_v2", bucket, prefix, max_files, contents)]


def _version_id(version_id: Any) -> str | None:
    """"null": an unversioned bucket's (or a pre-versioning) object, overwritable: pinned by its ETag, as a HEAD
    without a version id pins it."""
    return None if version_id in (None, "null") else str(version_id)


class _VersionsDenied(Exception):
    """ListObjectVersions refused (403, or 501 from a server without it): list without versions instead."""


def _listing(s3: S3Models, operation: str, bucket: str, prefix: str, max_files: int,
             entries: Callable[[dict[str, Any]], Iterable[dict[str, Any]]], *,
             versions: bool = False) -> list[dict[str, Any]]:
    """Every object ``operation``'s pages list under ``prefix`` (``entries`` of each page), directory markers left
    out, refused past ``max_files`` or when there is none; a missing or forbidden bucket a ModelRefError."""
    canonical = f"s3://{bucket}/{prefix}"
    found: list[dict[str, Any]] = []
    try:
        pages = s3.s3_client.get_paginator(operation).paginate(Bucket=bucket, Prefix=prefix)  # type: ignore[call-overload]
        for page in pages:
            for item in entries(page):
                if item["key"].endswith("/") and item["size"] == 0:
                    continue  # a "directory" marker, not a file
                found.append(item)
                if len(found) > max_files:
                    raise ModelRefError(f"{canonical} holds more than {max_files} objects, the most this service "
                                        "pins (COMPILESVC_HF_EXTRACT_MAX_FILES)")
    except ClientError as exc:
        if versions and http_status(exc) in (403, 501) and error_code(exc) != "NoSuchBucket":
            raise _VersionsDenied() from None
        refusal = _denied_or_missing(exc, canonical)
        if refusal is not None:
            raise refusal from None
        raise_store_error(exc, f"listing {canonical}")
    except ModelRefError:
        raise
    except Exception as exc:
        raise_store_error(exc, f"listing {canonical}")
    if not found:
        raise ModelRefError(f"{canonical} holds no objects: upload the checkpoint directory under it")
    return found


def _head(s3: S3Models, bucket: str, key: str, checksum: bool, version_id: str | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version_id:
        kwargs["VersionId"] = version_id
    if checksum:
        kwargs["ChecksumMode"] = "ENABLED"
    try:
        return dict(s3.s3_client.head_object(**kwargs))
    except ClientError as exc:
        refusal = _denied_or_missing(exc, f"s3://{bucket}/{key}")
        if refusal is not None:  # deleted since it was listed
            raise ModelChangedError(f"s3://{bucket}/{key} changed while the checkpoint was being pinned; retry once "
                                    "writes to it stop") from None
        raise_store_error(exc, f"looking up s3://{bucket}/{key}")
    except Exception as exc:
        raise_store_error(exc, f"looking up s3://{bucket}/{key}")


def _relative(key: str, prefix: str, canonical: str) -> str:
    """A listed key as a path inside the checkpoint; a key outside the prefix (only a misbehaving S3-compatible
    server lists one) is refused rather than pinned."""
    if not key.startswith(prefix):
        raise ModelRefError(f"the listing of {canonical} named {key!r}, which is not under it")
    return safe_relative(key[len(prefix):], f"object {key!r} under {canonical}")


def pin_prefix(s3: S3Models, ref: ModelRef, max_files: int, *, weight_digests: bool, max_bytes: int,
               layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS) -> PinnedModel:
    """Pin every object under ``ref``'s prefix (see the module docstring); refused past ``max_files`` objects or
    ``max_bytes`` in all (the worker's caps for one checkpoint). ``layouts``: the compiling NxDI's loader order."""
    bucket, prefix = parse_s3_uri(ref.uri)
    canonical = f"s3://{bucket}/{prefix}"
    objects: dict[str, dict[str, Any]] = {}
    headed: set[str] = set()  # the objects whose HEAD (and checksum, when weight_digests) is known
    listed_versions = _latest_versions(s3, bucket, prefix, max_files)
    if listed_versions is not None:
        for item in listed_versions:
            name = _relative(str(item["key"]), prefix, canonical)
            objects[name] = {"path": name, **item, "sha256": None}
    else:
        # ListBucketVersions denied: list the keys, then HEAD each one for its version id (the slow path).
        for key in _list(s3, bucket, prefix, max_files):
            name = _relative(key, prefix, canonical)
            head = _head(s3, bucket, key, weight_digests)
            objects[name] = {"path": name, "key": key, "version_id": _version_id(head.get("VersionId")),
                             "etag": str(head["ETag"]), "size": int(head["ContentLength"]),
                             "sha256": full_object_sha256(head) if weight_digests else None}
            headed.add(name)
    check_total_size(sum(int(e["size"]) for e in objects.values()), canonical, max_bytes)
    read: dict[str, bytes] = {}

    def read_small(name: str) -> bytes:
        entry = objects[name]
        limit = _SMALL_LIMITS.get(name.rsplit("/", 1)[-1], CONFIG_MAX_BYTES)
        if entry["size"] > limit:
            raise ModelRefError(f"not a checkpoint NxD Inference can compile: s3://{bucket}/{entry['key']} is larger "
                                f"than {limit // 1024**2} MiB")
        data = bytearray()
        try:
            s3.stream(bucket, entry["key"], entry["version_id"], entry["etag"], entry["size"], sink=data.extend)
        except ObjectChanged:
            raise ModelChangedError(f"s3://{bucket}/{entry['key']} changed while the checkpoint was being pinned; "
                                    "retry once writes to it stop") from None
        read[name] = bytes(data)
        return read[name]

    hashing: list[Progress] = []  # large weight files hashed in the background: each one's job started at once

    def weight_sha256(name: str) -> str:
        entry = objects[name]
        if entry["sha256"] is None:
            try:
                entry["sha256"] = s3.object_sha256(bucket, entry["key"], entry["version_id"], entry["etag"],
                                                   entry["size"])
            except ObjectChanged:
                raise ModelChangedError(f"s3://{bucket}/{entry['key']} changed while the checkpoint was being "
                                        "pinned; retry once writes to it stop") from None
            except ModelPinning as exc:
                hashing.append(Progress(exc.done, exc.total))
                return "0" * 64  # never used: the pin answers ModelPinning below
        return str(entry["sha256"])

    def checksummed_sha256(name: str) -> str:
        """A weight file's S3 full-object SHA-256 (one HEAD of its pinned version: the listing has no checksums),
        then :func:`weight_sha256` as before."""
        entry = objects[name]
        if name not in headed:
            head = _head(s3, bucket, entry["key"], True, entry["version_id"])
            if str(head["ETag"]) != entry["etag"] or int(head["ContentLength"]) != entry["size"]:
                raise ModelChangedError(f"s3://{bucket}/{entry['key']} changed while the checkpoint was being "
                                        "pinned; retry once writes to it stop")
            entry["sha256"] = full_object_sha256(head)
            headed.add(name)
        return weight_sha256(name)

    digests = checksummed_sha256 if weight_digests else None
    small = prefix_reads.small_files(objects, layouts)
    reads = None if small is None else prefix_reads.reads_key(bucket, objects, small)
    reading = None if reads is None else prefix_reads.remembered(s3.sessions, reads)
    if reading is not None:
        material, config_sha256 = prefix_reads.material(reading, objects, digests, layouts)
    else:
        material, config_sha256 = material_of(objects, read_small, digests, layouts)
        if reads is not None and small is not None:
            index = (small[1], read[small[1]]) if len(small) > 1 else None
            prefix_reads.remember(s3.sessions, reads,
                                  prefix_reads.reading_of(material.config, config_sha256, index))
    if hashing:
        raise pinning(f"{len(hashing)} weight file(s) under {canonical}", hashing)
    listed = sorted(objects.values(), key=lambda entry: str(entry["path"]))
    sha256 = listing_sha256([e["path"], e["version_id"] or "", e["etag"], e["size"]] for e in listed)
    fetch = {"kind": "s3-prefix", "bucket": bucket, "prefix": prefix, "sha256": sha256, "objects": listed,
             "verify": verify_digests(material, config_sha256)}
    return PinnedModel(ref.uri, ref.format, sha256, sum(int(e["size"]) for e in listed), fetch, material)


def fetch_prefix(s3: S3Models, fetch: dict[str, Any], dest: Path) -> None:
    """Each pinned object of ``fetch`` (from :func:`pin_prefix`) written under ``dest`` at its relative path:
    exactly its pinned version (IfMatch its ETag), of its pinned size and, when pinned, sha256."""
    bucket = str(fetch["bucket"])
    for entry in fetch["objects"]:
        name = safe_relative(str(entry["path"]), "model.uri")
        key, version_id, etag, size = str(entry["key"]), entry.get("version_id"), str(entry["etag"]), int(entry["size"])
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with open(partial, "wb") as out:
            try:
                sha256, got = s3.stream(bucket, key, version_id, etag, size, sink=out.write)
            except ObjectChanged:
                which = f"version {version_id}" if version_id else f"ETag {etag}"
                raise ModelChangedError(f"s3://{bucket}/{key} changed since it was pinned ({which} is gone); "
                                        "resubmit the build to pin the current object") from None
        pinned_sha = entry.get("sha256")
        if got != size or (pinned_sha and sha256 != pinned_sha):
            partial.unlink()
            raise ModelChangedError(f"s3://{bucket}/{key} is not the object pinned (size or sha256 differ); "
                                    "resubmit the build to pin it again")
        partial.replace(target)
