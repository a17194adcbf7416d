"""Manifests: the published description of a bucket compile and of an artifact (a set of buckets).

A bucket manifest is written after every file it names; the artifact manifest after every bucket
manifest; both create-only. A serving fleet needs nothing else to verify what it downloads: each file has
its size and sha256, and the toolchain versions it was built with (a runtime must match them).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

BUCKET_MANIFEST_SCHEMA = "compilesvc-bucket-manifest/1"
ARTIFACT_MANIFEST_SCHEMA = "compilesvc-artifact-manifest/1"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True, indent=1).encode()


class FileEntry(_Doc):
    path: str = Field(description="Path of the file within the bucket's artifact directory.")
    role: str = Field(description="model | log | aux")
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


class ArtifactManifest(_Doc):
    schema_: str = Field(default=ARTIFACT_MANIFEST_SCHEMA, alias="schema")
    key: str
    material: dict[str, Any]
    components: dict[str, str]
    buckets: list[ArtifactBucketEntry]
    size_bytes: int
    created_at: str


def parse_bucket_manifest(data: bytes) -> BucketManifest:
    return BucketManifest.model_validate_json(data)


def parse_artifact_manifest(data: bytes) -> ArtifactManifest:
    return ArtifactManifest.model_validate_json(data)
