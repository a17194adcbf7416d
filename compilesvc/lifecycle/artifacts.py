"""An artifact's lifecycle in the ledger (its state and the state of the builds following it), and a
published artifact read back and described for clients.

Writing manifests to the store is :mod:`compilesvc.compiles.publishing`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.ledger import events
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, utcnow
from compilesvc.spec.manifest import ArtifactManifest, parse_artifact_manifest
from compilesvc.states import BUILD_STATE_FOR_ARTIFACT, ArtifactState, BuildState
from compilesvc.store import ArtifactStore
from compilesvc.store.base import UrlSigner, artifact_manifest_name

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


def read_manifest(store: ArtifactStore, key: str) -> ArtifactManifest | None:
    raw = store.read_document(artifact_manifest_name(key))
    return parse_artifact_manifest(raw, key) if raw is not None else None


class PublishedManifests(Protocol):
    """Where the manifest of an artifact the ledger calls published is read (the API reads it through a
    cache: published manifests never change)."""

    def published_manifest(self, key: str) -> ArtifactManifest | None: ...


class StoreManifests:
    """:class:`PublishedManifests` read from the store each time."""

    def __init__(self, store: ArtifactStore):
        self.store = store

    def published_manifest(self, key: str) -> ArtifactManifest | None:
        return read_manifest(self.store, key)


def describe_layout(manifest: ArtifactManifest) -> dict[str, Any]:
    """A published artifact as clients see it, without its download URLs (:func:`with_urls` adds them)."""
    return manifest.model_dump(mode="json", by_alias=True)


def with_urls(layout: dict[str, Any], signer: UrlSigner, ttl: int) -> dict[str, Any]:
    """``layout`` with a download URL, signed now, in every file and log entry; ``layout`` is not changed
    (callers keep one layout and sign it per request)."""

    def signed(entry: dict[str, Any]) -> dict[str, Any]:
        filename = entry["path"].rsplit("/", 1)[-1]
        return {**entry, "url": signer.blob_url(entry["sha256"], expires_in=ttl, filename=filename)}

    buckets = [{**bucket, "files": [signed(f) for f in bucket["files"]],
                "log": signed(bucket["log"]) if bucket.get("log") else bucket.get("log")}
               for bucket in layout["buckets"]]
    return {**layout, "buckets": buckets, "urls_expire_in": ttl}


def describe(manifest: ArtifactManifest, signer: UrlSigner, ttl: int) -> dict[str, Any]:
    """A published artifact as clients see it: the manifest plus fresh expiring download URLs."""
    return with_urls(describe_layout(manifest), signer, ttl)
