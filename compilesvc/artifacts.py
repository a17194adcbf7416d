"""Artifact lifecycle: publishing a set once all its bucket compiles succeeded, failing it when one fails
for good, importing a manifest found in the store, and describing a published artifact for clients.

Publishing order is blobs, bucket manifests (written by the workers), then the artifact manifest here,
then the ledger. A crash anywhere in between leaves either nothing visible or a complete manifest that the
next pass (worker, reaper or a submit) finds and records.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc import events
from compilesvc.db import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, utcnow
from compilesvc.manifest import (
    ArtifactBucketEntry,
    ArtifactManifest,
    parse_artifact_manifest,
    parse_bucket_manifest,
)
from compilesvc.states import BUILD_STATE_FOR_ARTIFACT, ArtifactState, BucketState, BuildState
from compilesvc.store import ArtifactStore, StoreError
from compilesvc.store.base import artifact_manifest_name, bucket_manifest_name

log = logging.getLogger(__name__)



def set_artifact_state(session: Session, artifact: Artifact, state: ArtifactState, **detail: Any) -> None:
    """Move an artifact and the builds following it (those still building) to ``state``."""
    if artifact.state == state:
        return
    events.record(session, "artifact", artifact.id, artifact.state, state, **detail)
    artifact.state = state
    build_state = BUILD_STATE_FOR_ARTIFACT[state]
    finished = utcnow() if build_state != BuildState.BUILDING else None
    follow_from = ((BuildState.BUILDING,) if state != ArtifactState.BUILDING
                   else (BuildState.FAILED, BuildState.CANCELLED))
    builds = session.scalars(
        select(Build).where(Build.artifact_id == artifact.id, Build.state.in_(follow_from))
    ).all()
    for build in builds:
        if state == ArtifactState.BUILDING and build.state == BuildState.CANCELLED:
            continue  # a build its owner cancelled stays cancelled; a new submit makes a new build
        events.record(session, "build", build.id, build.state, build_state)
        build.state = build_state
        build.finished_at = finished


def fail_artifacts_of_bucket(session: Session, bucket: BucketCompile, *, also_cancelled: bool = False) -> None:
    """A bucket compile failed for good: every set still building that contains it fails too (and, with
    ``also_cancelled``, every cancelled one: a resubmit of it is answered with the failure)."""
    states = (ArtifactState.BUILDING, ArtifactState.CANCELLED) if also_cancelled else (ArtifactState.BUILDING,)
    artifacts = session.scalars(
        select(Artifact)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == Artifact.id)
        .where(ArtifactBucket.bucket_compile_id == bucket.id, Artifact.state.in_(states))
        .with_for_update()
    ).all()
    for artifact in artifacts:
        set_artifact_state(session, artifact, ArtifactState.FAILED, bucket=bucket.key, error_class=bucket.error_class,
                           error_code=bucket.error_code)


def _bucket_rows(session: Session, artifact_id: int) -> list[tuple[BucketCompile, int]]:
    rows = session.execute(
        select(BucketCompile, ArtifactBucket.position)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
        .where(ArtifactBucket.artifact_id == artifact_id)
        .order_by(ArtifactBucket.position)
    ).all()
    return [(bucket, position) for bucket, position in rows]


def build_artifact_manifest(store: ArtifactStore, artifact: Artifact,
                            buckets: list[tuple[BucketCompile, int]]) -> ArtifactManifest:
    entries = []
    for bucket, position in buckets:
        raw = store.read_document(bucket_manifest_name(bucket.key))
        if raw is None:
            raise StoreError(f"bucket manifest for {bucket.key} is missing from the store")
        manifest = parse_bucket_manifest(raw, bucket.key)
        entries.append(ArtifactBucketEntry(
            key=bucket.key, position=position, inputs=manifest.inputs,
            manifest=bucket_manifest_name(bucket.key), files=manifest.files, log=manifest.log,
            versions=manifest.versions, compile_seconds=manifest.compile_seconds,
        ))
    size = sum(f.size for e in entries for f in e.files)
    return ArtifactManifest(key=artifact.key, material=artifact.material, components=artifact.components,
                            buckets=entries, size_bytes=size, created_at=datetime.now(UTC).isoformat())


def publish_if_complete(store: ArtifactStore, sessions: sessionmaker[Session], artifact_id: int) -> str:
    """Publish the artifact if every bucket succeeded; returns the artifact's state afterwards."""
    with sessions() as session:
        artifact = session.get(Artifact, artifact_id)
        if artifact is None:
            raise LookupError(f"no artifact {artifact_id}")
        if artifact.state != ArtifactState.BUILDING:
            return artifact.state
        buckets = _bucket_rows(session, artifact_id)
        if not buckets or any(b.state != BucketState.SUCCEEDED for b, _ in buckets):
            return artifact.state
    name = artifact_manifest_name(artifact.key)
    manifest = build_artifact_manifest(store, artifact, buckets)
    if not store.create_document(name, manifest.to_bytes()):
        existing = store.read_document(name)  # another publisher won the race; theirs is as good
        if existing is None:
            raise StoreError(f"{name} exists but cannot be read")
        manifest = parse_artifact_manifest(existing, artifact.key)
    with transaction(sessions) as session:
        claimed = session.execute(
            update(Artifact)
            .where(Artifact.id == artifact_id, Artifact.state == ArtifactState.BUILDING)
            .values(manifest_uri=store.document_location(name), size_bytes=manifest.size_bytes,
                    published_at=utcnow())
            .returning(Artifact.id)
        ).scalar_one_or_none()
        artifact = session.get_one(Artifact, artifact_id)
        if claimed is not None:
            set_artifact_state(session, artifact, ArtifactState.PUBLISHED)
            log.info("artifact published", extra={"artifact_key": artifact.key})
        return artifact.state


def publish_ready_artifacts(store: ArtifactStore, sessions: sessionmaker[Session], bucket_id: int) -> None:
    """After a bucket succeeded: publish each set containing it that is now complete."""
    with sessions() as session:
        artifact_ids = session.scalars(
            select(ArtifactBucket.artifact_id)
            .join(Artifact, Artifact.id == ArtifactBucket.artifact_id)
            .where(ArtifactBucket.bucket_compile_id == bucket_id, Artifact.state == ArtifactState.BUILDING)
        ).all()
    for artifact_id in artifact_ids:
        publish_if_complete(store, sessions, artifact_id)


def read_manifest(store: ArtifactStore, key: str) -> ArtifactManifest | None:
    raw = store.read_document(artifact_manifest_name(key))
    return parse_artifact_manifest(raw, key) if raw is not None else None


def describe(manifest: ArtifactManifest, store: ArtifactStore, ttl: int) -> dict[str, Any]:
    """A published artifact as clients see it: the manifest plus fresh expiring download URLs."""
    body = manifest.model_dump(mode="json", by_alias=True)
    for bucket in body["buckets"]:
        for entry in [*bucket["files"], *([bucket["log"]] if bucket.get("log") else [])]:
            filename = entry["path"].rsplit("/", 1)[-1]
            entry["url"] = store.blob_url(entry["sha256"], expires_in=ttl, filename=filename)
    body["urls_expire_in"] = ttl
    return body
