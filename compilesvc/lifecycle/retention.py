"""Retention: which artifacts the policy releases, and the garbage collection of what they leave behind.

The policy (settings ``retention_*``, overridable per run): an artifact is **released** when it is
published, matches no pin, was not fetched by key for ``unfetched`` (lookups are counted by
:mod:`compilesvc.lifecycle.fetch_stats`), and either was published longer ago than ``min_age`` or belongs to a
retired release. Pins keep an artifact (by key), every artifact of a model name, or every artifact with a
build carrying a label.

A run (``compilesvc gc``) has two steps:

1. **Mark.** Each released artifact moves to ``deleted`` (checked again under its row lock), and so does
   every bucket compile no other artifact still holds (a building, failed or published set keeps its
   buckets). New lookups answer 404 and a resubmit builds them again; files stay for now.
2. **Sweep.** ``grace`` after the mark (longer than any API process trusts a cached manifest: 60 s), the
   manifests of deleted artifacts and buckets are removed, and the files those bucket manifests named,
   unless a live manifest names them too or they are a build's model. Any other blob no manifest names
   (an upload not submitted yet, outputs of a compile that died before its manifest) goes only once it is
   older than ``min_age``, so nothing a build in flight or a user about to submit needs is touched.

A dry run computes the same lists, as if the marks were made now, and changes nothing. Every run and
what it deleted (or would) is recorded in ``gc_runs`` / ``gc_deletions``; marks are events too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.ledger import events
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, BuildLabel, utcnow
from compilesvc.ledger.retention import GcDeletion, GcRun, RetentionPin
from compilesvc.lifecycle.artifacts import set_artifact_state
from compilesvc.spec.manifest import ManifestMismatch, parse_bucket_manifest
from compilesvc.states import ArtifactState, BucketState, PinKind
from compilesvc.store import ArtifactStore
from compilesvc.store.base import (
    StoredBlob,
    artifact_manifest_name,
    artifact_provenance_name,
    artifact_signature_name,
    bucket_manifest_name,
)

log = logging.getLogger(__name__)
DAY = timedelta(days=1)


def parse_retired(text: str) -> frozenset[tuple[str | None, str]]:
    """``"2.19.0, cpu:2.12.0"`` -> {(None, "2.19.0"), ("cpu", "2.12.0")}; ValueError names a bad entry."""
    out = set()
    for part in text.replace(",", " ").split():
        target, _, sdk = part.rpartition(":")
        if not sdk or not all(p.isdigit() for p in sdk.split(".")) or sdk.count(".") != 2:
            raise ValueError(f"{part!r}: expected a release such as 2.19.0, or target:release such as cpu:2.12.0")
        out.add((target or None, sdk))
    return frozenset(out)


@dataclass(frozen=True)
class Policy:
    min_age: timedelta
    unfetched: timedelta
    retired: frozenset[tuple[str | None, str]]
    grace: timedelta

    @classmethod
    def from_settings(cls, settings: Settings, *, min_age_days: float | None = None,
                      unfetched_days: float | None = None, retired: str | None = None,
                      grace_seconds: float | None = None) -> Policy:
        return cls(min_age=DAY * (settings.retention_min_age_days if min_age_days is None else min_age_days),
                   unfetched=DAY * (settings.retention_unfetched_days if unfetched_days is None else unfetched_days),
                   retired=parse_retired(settings.retention_retired_sdks if retired is None else retired),
                   grace=timedelta(seconds=settings.gc_grace_seconds if grace_seconds is None else grace_seconds))

    def to_json(self) -> dict[str, Any]:
        return {"min_age_days": self.min_age / DAY, "unfetched_days": self.unfetched / DAY,
                "retired": sorted(f"{t}:{s}" if t else s for t, s in self.retired),
                "grace_seconds": self.grace.total_seconds()}


@dataclass(frozen=True)
class Released:
    id: int
    key: str
    reason: str
    size_bytes: int | None


def pinned() -> Any:
    """SQL: the artifact matches a pin (by key, by a build's model name, by a build's label)."""
    by_key = exists().where(RetentionPin.kind == PinKind.ARTIFACT, RetentionPin.value == Artifact.key)
    by_model = exists().where(RetentionPin.kind == PinKind.MODEL, Build.artifact_id == Artifact.id,
                              Build.model_name == RetentionPin.value)
    by_label = exists().where(RetentionPin.kind == PinKind.LABEL, Build.artifact_id == Artifact.id,
                              BuildLabel.build_id == Build.id,
                              RetentionPin.value == BuildLabel.name + ":" + BuildLabel.value)
    return or_(by_key, by_model, by_label)


def released(session: Session, policy: Policy, now: datetime, *, only: int | None = None) -> list[Released]:
    """The artifacts ``policy`` releases at ``now`` (``only``: is this one still released?)."""
    unfetched = or_(Artifact.last_fetched_at.is_(None), Artifact.last_fetched_at < now - policy.unfetched)
    published = Artifact.published_at.is_not(None)
    aged = or_(and_(published, Artifact.published_at < now - policy.min_age),
               and_(~published, Artifact.created_at < now - policy.min_age))
    retired = [and_(Artifact.sdk == sdk, *([Artifact.target == target] if target else []))
               for target, sdk in sorted(policy.retired, key=str)]
    query = (select(Artifact.id, Artifact.key, Artifact.size_bytes, aged.label("aged"))
             .where(Artifact.state == ArtifactState.PUBLISHED, unfetched, or_(aged, *retired), ~pinned())
             .order_by(Artifact.id))
    if only is not None:
        query = query.where(Artifact.id == only)
    return [Released(row.id, row.key, "older than the policy, not fetched lately" if row.aged
                     else "a retired release, not fetched lately", row.size_bytes)
            for row in session.execute(query)]


def orphaned_buckets(session: Session, artifact_ids: list[int]) -> list[tuple[int, str]]:
    """Succeeded bucket compiles of these artifacts that no other artifact (not deleted) holds."""
    if not artifact_ids:
        return []
    # Aliased: the outer query joins artifact_buckets too, and an unaliased subquery would correlate to
    # the outer row (the very link being judged) instead of looking at the bucket's other links.
    link, holder = aliased(ArtifactBucket), aliased(Artifact)
    held_elsewhere = exists().where(
        link.bucket_compile_id == BucketCompile.id, link.artifact_id == holder.id,
        holder.id.not_in(artifact_ids), holder.state != ArtifactState.DELETED)
    rows = session.execute(
        select(BucketCompile.id, BucketCompile.key).distinct()
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
        .where(ArtifactBucket.artifact_id.in_(artifact_ids), BucketCompile.state == BucketState.SUCCEEDED,
               ~held_elsewhere).order_by(BucketCompile.id))
    return [(row.id, row.key) for row in rows]


@dataclass
class Sweep:
    """What the sweep removes from the store: the manifests of deleted artifacts and buckets, and blobs."""

    artifact_keys: list[str] = field(default_factory=list)
    bucket_keys: list[str] = field(default_factory=list)
    blobs: list[StoredBlob] = field(default_factory=list)

    @property
    def documents(self) -> list[tuple[str, str]]:
        """(name, reason) of every manifest removed."""
        return ([(artifact_manifest_name(k), f"artifact {k} deleted") for k in self.artifact_keys]
                + [(bucket_manifest_name(k), f"bucket {k} deleted") for k in self.bucket_keys])


def sweep_plan(session: Session, store: ArtifactStore, policy: Policy, now: datetime,
               marking: tuple[list[int], list[int]] = ([], [])) -> Sweep:
    """The documents and blobs a sweep at ``now`` removes; ``marking``: (artifact ids, bucket ids) a dry
    run treats as marked deleted at ``now``."""
    cutoff = now - policy.grace
    soon_artifacts, soon_buckets = marking
    due = now <= cutoff  # marks made now are past the grace only when the grace is zero
    sweep = Sweep()
    artifacts = session.execute(select(Artifact.id, Artifact.key).where(
        Artifact.manifest_uri.is_not(None),
        or_(and_(Artifact.state == ArtifactState.DELETED, Artifact.deleted_at <= cutoff),
            Artifact.id.in_(soon_artifacts if due else [])))).all()
    buckets = session.execute(select(BucketCompile.id, BucketCompile.key).where(
        BucketCompile.manifest_uri.is_not(None),
        or_(and_(BucketCompile.state == BucketState.DELETED, BucketCompile.deleted_at <= cutoff),
            BucketCompile.id.in_(soon_buckets if due else [])))).all()
    sweep.artifact_keys = [a.key for a in artifacts]
    sweep.bucket_keys = [b.key for b in buckets]
    swept_buckets = {b.id for b in buckets}
    referenced = set(session.scalars(select(Build.model_sha256).distinct()))
    outputs: set[str] = set()  # files of the buckets swept now: theirs to delete after the grace
    live = session.execute(select(BucketCompile.id, BucketCompile.key).where(BucketCompile.manifest_uri.is_not(None)))
    for bucket_id, key in live:
        named = _files_named(store, key)
        (outputs if bucket_id in swept_buckets else referenced).update(named)
    # Any other blob no manifest names (an upload never submitted, outputs of a compile that died before
    # its manifest) is garbage only once older than the policy's age: a user may submit tomorrow.
    upload_cutoff = now - max(policy.grace, policy.min_age)
    sweep.blobs = sorted((b for b in store.iter_blobs() if b.sha256 not in referenced and b.modified <= (
        cutoff if b.sha256 in outputs else upload_cutoff)), key=lambda b: b.sha256)
    return sweep


def _files_named(store: ArtifactStore, bucket_key: str) -> set[str]:
    """The sha256 of every file (and the log) a stored bucket manifest names (none if it is gone)."""
    raw = store.read_document(bucket_manifest_name(bucket_key))
    if raw is None:
        return set()
    try:
        manifest = parse_bucket_manifest(raw, bucket_key)
    except ManifestMismatch:
        log.warning("gc: a bucket manifest does not match its key; it is left alone", extra={"key": bucket_key})
        return set()
    return {f.sha256 for f in [*manifest.files, *([manifest.log] if manifest.log else [])]}


@dataclass
class GcReport:
    run_id: int
    dry_run: bool
    policy: dict[str, Any]
    artifacts: list[Released] = field(default_factory=list)
    buckets: list[str] = field(default_factory=list)
    sweep: Sweep = field(default_factory=Sweep)

    @property
    def bytes_freed(self) -> int:
        return sum(b.size for b in self.sweep.blobs)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "dry_run": self.dry_run, "policy": self.policy,
                "artifacts": [{"key": a.key, "reason": a.reason, "size_bytes": a.size_bytes} for a in self.artifacts],
                "buckets": self.buckets,
                "documents": [name for name, _ in self.sweep.documents],
                "blobs": [{"sha256": b.sha256, "size": b.size} for b in self.sweep.blobs],
                "bytes_freed": self.bytes_freed}


def run(sessions: sessionmaker[Session], store: ArtifactStore, policy: Policy, *, dry_run: bool,
        started_by: str | None = None) -> GcReport:
    """One garbage collection (see the module docstring); the report says what was (or would be) deleted."""
    now = utcnow()
    with transaction(sessions) as session:
        gc_run = GcRun(dry_run=dry_run, started_by=started_by, policy=policy.to_json(), started_at=now)
        session.add(gc_run)
        session.flush()
        report = GcReport(gc_run.id, dry_run, policy.to_json())
    with sessions() as session:
        candidates = released(session, policy, now)
    if dry_run:
        with sessions() as session:
            report.artifacts = candidates
            orphans = orphaned_buckets(session, [a.id for a in candidates])
            report.buckets = [key for _, key in orphans]
            report.sweep = sweep_plan(session, store, policy, now, ([a.id for a in candidates],
                                                                     [i for i, _ in orphans]))
    else:
        for candidate in candidates:
            marked = _mark(sessions, policy, now, candidate, report.run_id)
            if marked is not None:
                report.artifacts.append(candidate)
                report.buckets += marked
        with sessions() as session:
            report.sweep = sweep_plan(session, store, policy, now)
        _delete(sessions, store, report)
    _record(sessions, report)
    return report


def _mark(sessions: sessionmaker[Session], policy: Policy, now: datetime, candidate: Released,
          run_id: int) -> list[str] | None:
    """Mark one artifact (and the buckets only it holds) deleted, if it is still released under its lock."""
    with transaction(sessions) as session:
        artifact = session.scalars(select(Artifact).where(Artifact.id == candidate.id).with_for_update()).one()
        if not released(session, policy, now, only=candidate.id):
            return None  # pinned, fetched or rebuilt since the plan
        orphans = orphaned_buckets(session, [artifact.id])
        set_artifact_state(session, artifact, ArtifactState.DELETED, reason="retention", gc_run=run_id)
        artifact.deleted_at = now
        for bucket_id, _ in orphans:
            bucket = session.scalars(select(BucketCompile).where(BucketCompile.id == bucket_id).with_for_update()).one()
            if bucket.state != BucketState.SUCCEEDED:
                continue
            events.record(session, "bucket", bucket.id, bucket.state, BucketState.DELETED, reason="retention",
                          gc_run=run_id)
            bucket.state, bucket.deleted_at = BucketState.DELETED, now
        return [key for _, key in orphans]


def _delete(sessions: sessionmaker[Session], store: ArtifactStore, report: GcReport) -> None:
    """Remove what the sweep found; a document's owner no longer names it once it is gone."""
    for key in report.sweep.artifact_keys:
        store.delete_document(artifact_manifest_name(key))
        store.delete_document(artifact_signature_name(key))
        store.delete_document(artifact_provenance_name(key))
        with transaction(sessions) as session:  # swept: the next run does not look for it again
            session.execute(update(Artifact).where(Artifact.key == key, Artifact.state == ArtifactState.DELETED)
                            .values(manifest_uri=None))
    for key in report.sweep.bucket_keys:
        store.delete_document(bucket_manifest_name(key))
        with transaction(sessions) as session:
            session.execute(update(BucketCompile).where(BucketCompile.key == key,
                                                        BucketCompile.state == BucketState.DELETED)
                            .values(manifest_uri=None))
    for blob in report.sweep.blobs:
        store.delete_blob(blob.sha256)


def _record(sessions: sessionmaker[Session], report: GcReport) -> None:
    with transaction(sessions) as session:
        rows = [{"kind": "artifact", "name": a.key, "size_bytes": a.size_bytes, "reason": a.reason}
                for a in report.artifacts]
        rows += [{"kind": "bucket", "name": key, "size_bytes": None, "reason": "held by deleted artifacts only"}
                 for key in report.buckets]
        rows += [{"kind": "document", "name": name, "size_bytes": None, "reason": reason}
                 for name, reason in report.sweep.documents]
        rows += [{"kind": "blob", "name": b.sha256, "size_bytes": b.size, "reason": "named by no live manifest"}
                 for b in report.sweep.blobs]
        session.add_all(GcDeletion(run_id=report.run_id, **row) for row in rows)
        gc_run = session.get_one(GcRun, report.run_id)
        gc_run.finished_at = utcnow()
        gc_run.artifacts, gc_run.documents = len(report.artifacts), len(report.sweep.documents)
        gc_run.blobs, gc_run.bytes_freed = len(report.sweep.blobs), report.bytes_freed
