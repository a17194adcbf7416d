"""Bucket compiles as the submit path, build control and the lease holders share them: a set's compiles
read for clients (:class:`BucketView`), locked for writing in the one lock order, and put back in the queue.

The state machine a compile moves through is :mod:`compilesvc.states`'; its leases are
:mod:`compilesvc.compiles.leases`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from compilesvc.compiles import failures
from compilesvc.compiles.failures import Failure
from compilesvc.dispatch.outbox import enqueue_compile
from compilesvc.ledger import events
from compilesvc.ledger.models import ArtifactBucket, BucketCompile, utcnow
from compilesvc.states import BucketState


@dataclass(frozen=True)
class BucketView:
    key: str
    position: int
    inputs: list[dict[str, Any]]
    state: str
    attempts: int
    error_class: str | None
    error_code: str | None
    error_message: str | None
    worker_id: str | None
    started_at: datetime | None
    finished_at: datetime | None
    compile_seconds: float | None
    failures: tuple[Failure, ...] = ()
    compile_id: int | None = None
    queued_at: datetime | None = None
    origin_build_id: int | None = None  # the build that queued it last (compilesvc.builds.provenance)
    cancel_requested: bool = False  # running, told to stop: the worker has not ended it yet
    interruptions: int = 0  # attempts a draining worker handed back (not counted against max_attempts)

    @property
    def id(self) -> int | None:
        return self.compile_id

    @classmethod
    def of(cls, bucket: BucketCompile | Row[Any], position: int, history: Sequence[Failure] = ()) -> BucketView:
        """A compile (an ORM object, or a row of :data:`_VIEW_COLUMNS`) at ``position`` in its set."""
        return cls(key=bucket.key, position=position, inputs=bucket.inputs, state=bucket.state,
                   attempts=bucket.attempts, error_class=bucket.error_class, error_code=bucket.error_code,
                   error_message=bucket.error_message, worker_id=bucket.worker_id,
                   started_at=bucket.started_at, finished_at=bucket.finished_at,
                   compile_seconds=bucket.compile_seconds, failures=tuple(history), compile_id=bucket.id,
                   queued_at=bucket.queued_at, origin_build_id=bucket.origin_build_id,
                   cancel_requested=bool(bucket.cancel_requested), interruptions=bucket.interruptions or 0)


def positioned_buckets(session: Session, artifact_id: int) -> list[tuple[BucketCompile, int]]:
    """The artifact's bucket compiles with their positions in its spec, in position order."""
    rows = session.execute(
        select(BucketCompile, ArtifactBucket.position)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
        .where(ArtifactBucket.artifact_id == artifact_id)
        .order_by(ArtifactBucket.position)
    ).all()
    return [(bucket, position) for bucket, position in rows]


#: What a :class:`BucketView` shows of a compile (read as columns: no ORM objects for an answer).
_VIEW_COLUMNS = (BucketCompile.id, BucketCompile.key, BucketCompile.inputs, BucketCompile.state,
                 BucketCompile.attempts, BucketCompile.error_class, BucketCompile.error_code,
                 BucketCompile.error_message, BucketCompile.worker_id, BucketCompile.started_at,
                 BucketCompile.finished_at, BucketCompile.compile_seconds, BucketCompile.queued_at,
                 BucketCompile.origin_build_id, BucketCompile.cancel_requested, BucketCompile.interruptions)


def bucket_views(session: Session, artifact_id: int, *, history: bool = True) -> list[BucketView]:
    """The artifact's bucket compiles in position order, each with its failure history (unless ``history``
    is false: one query fewer, for a caller that only looks at states)."""
    rows = session.execute(
        select(*_VIEW_COLUMNS, ArtifactBucket.position)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
        .where(ArtifactBucket.artifact_id == artifact_id)
        .order_by(ArtifactBucket.position)
    ).all()
    return views_of(session, [(row, row.position) for row in rows], history=history)


def views_of(session: Session, rows: Sequence[tuple[BucketCompile | Row[Any], int]], *,
             history: bool = True) -> list[BucketView]:
    """:func:`bucket_views` of compiles already read (:func:`positioned_buckets`, or rows of columns)."""
    found = failures.of_buckets(session, [bucket.id for bucket, _ in rows] if history else [])
    return [BucketView.of(bucket, position, found.get(bucket.id, ())) for bucket, position in rows]


def requeue_bucket(session: Session, bucket: BucketCompile, reason: str, *, reset_attempts: bool,
                   model: dict[str, Any] | None = None, delay_seconds: float = 0.0) -> int:
    """Put a finished/abandoned bucket compile back in the queue; returns the outbox row id.

    ``model`` replaces where the worker fetches the model from: a new submit's pin of the same bytes (the
    key holds their sha256) may well outlive the old one, whose S3 version or file can be gone.
    ``delay_seconds`` holds the dispatch back (a retry's backoff); the compile is queued meanwhile.
    """
    events.record(session, "bucket", bucket.id, bucket.state, BucketState.QUEUED, reason=reason,
                  **({"retry_in": round(delay_seconds, 1)} if delay_seconds else {}))
    if model is not None:
        bucket.model = model
    bucket.state = BucketState.QUEUED
    bucket.lease_token += 1  # fences off any worker still holding the old lease
    bucket.lease_expires_at = None
    bucket.worker_id = None
    bucket.cancel_requested = False
    bucket.error_class = bucket.error_code = bucket.error_message = None
    bucket.queued_at = utcnow()
    if reset_attempts:
        bucket.attempts = 0
        bucket.interruptions = 0
        bucket.attempt_round += 1  # failures of earlier rounds no longer count against this one
    return enqueue_compile(session, bucket, delay_seconds=delay_seconds).id


def linked_buckets(session: Session, artifact_id: int) -> list[BucketCompile]:
    """The bucket compiles of an artifact, locked, in key order (the lock order every writer uses)."""
    return list(session.scalars(
        select(BucketCompile)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
        .where(ArtifactBucket.artifact_id == artifact_id)
        .order_by(BucketCompile.key)
        .with_for_update()
    ))
