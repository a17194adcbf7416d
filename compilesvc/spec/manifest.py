"""Manifests: the published description of a bucket compile and of an artifact (a set of buckets).

A bucket manifest is written after every file it names; the artifact manifest after every bucket
manifest; both create-only. A serving fleet needs nothing else to verify what it downloads: each file has
its size and sha256, and the toolchain versions it was built with (a runtime must match them).

Manifests are read back only through :func:`parse_bucket_manifest` and :func:`parse_artifact_manifest`,
which check that the document's own key material derives the key it is stored under: a corrupt or foreign
document is refused (:class:`ManifestMismatch`) rather than served as someone else's binary.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compilesvc.spec.keys import artifact_key_of, bucket_key_of

BUCKET_MANIFEST_SCHEMA = "compilesvc-bucket-manifest/1"
ARTIFACT_MANIFEST_SCHEMA = "compilesvc-artifact-manifest/1"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True, indent=1).encode()


class FileEntry(_Doc):
    path: str = Field(description="Path of the file within the bucket's artifact directory.")
    role: str = Field(description="model | model-shard | weights-shard | log | aux (docs/api.md)")
    size: int
    sha256: str


class BucketManifest(_Doc):
    schema_: str = Field(default=BUCKET_MANIFEST_SCHEMA, alias="schema")
    key: str
    material: dict[str, Any]
    inputs: list[dict[str, Any]]
    files: list[FileEntry]
    log: FileEntry | None = None
    versions: dict[str, Any] = Field(default_factory=dict)
    worker: str | None = None
    compile_seconds: float | None = None
    created_at: str


class ArtifactBucketEntry(_Doc):
    key: str
    position: int
    inputs: list[dict[str, Any]]
    manifest: str = Field(description="Store name of the bucket manifest.")
    files: list[FileEntry]
    log: FileEntry | None = None
    versions: dict[str, Any] = Field(default_factory=dict)
    compile_seconds: float | None = None

    def placed(self, entry: FileEntry) -> str:
        """Where ``entry`` lies in a fetched artifact directory: ``bucket-<position>/<path>`` (the layout
        the fleet cache, the signature and ``compilesvc verify`` share)."""
        return f"{bucket_dir(self.position)}/{entry.path}"


def bucket_dir(position: int) -> str:
    """A bucket's directory in a fetched artifact directory."""
    return f"bucket-{position}"


class ArtifactManifest(_Doc):
    schema_: str = Field(default=ARTIFACT_MANIFEST_SCHEMA, alias="schema")
    key: str
    material: dict[str, Any]
    components: dict[str, str]
    buckets: list[ArtifactBucketEntry]
    size_bytes: int
    created_at: str


class ManifestMismatch(ValueError):
    """A stored manifest that is unreadable or does not derive the key it is stored under."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"the stored manifest for key {key} {problem}")


def parse_bucket_manifest(data: bytes, key: str) -> BucketManifest:
    """The bucket manifest stored under ``key``, verified against it."""
    try:
        manifest = BucketManifest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestMismatch(key, f"is not a bucket manifest ({exc.error_count()} errors)") from None
    if manifest.key != key or bucket_key_of(manifest.material, manifest.inputs) != key:
        raise ManifestMismatch(key, "names or hashes to another key")
    return manifest


def parse_artifact_manifest(data: bytes, key: str) -> ArtifactManifest:
    """The artifact manifest stored under ``key``, verified against it (and each bucket entry too)."""
    try:
        manifest = ArtifactManifest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestMismatch(key, f"is not an artifact manifest ({exc.error_count()} errors)") from None
    material = manifest.material
    if (manifest.key != key
            or any(bucket_key_of(material, entry.inputs) != entry.key for entry in manifest.buckets)
            or artifact_key_of(material, [entry.key for entry in manifest.buckets]) != key):
        raise ManifestMismatch(key, "names or hashes to another key")
    return manifest


def safe_relative(path: str) -> PurePosixPath:
    """A manifest path as a relative path that stays inside its directory; ValueError otherwise."""
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"refusing unsafe path {path!r} in the manifest")
    return relative
