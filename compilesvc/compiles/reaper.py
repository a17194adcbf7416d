"""The reaper: recovers work that a crash left behind. Every step is idempotent and safe to run from
several processes at once (each ``compilesvc relay`` process runs it).

1. Running compiles whose lease ran out: requeued (the token bump fences the silent worker off) or,
   after ``max_attempts``, failed as infra (:func:`compilesvc.compiles.leases.expire`).
2. Artifacts still ``building`` although every compile in them succeeded: a worker died between
   recording its compile and publishing the set. :func:`publish_if_complete` finishes the job.
3. Workers whose heartbeat is older than ``worker_stale_seconds``: reported only. The registry's readers
   ignore them already, and their compiles come back through their leases, not through the registry.
4. Queued compiles whose message the broker lost (restarted empty, flushed): re-sent
   (:class:`compilesvc.compiles.reconcile.Reconciler`, given by the relay loop, which keeps its state across passes).
5. Compiles dispatched and left unclaimed while a worker of their queue idles with a free slot: reported, and
   that worker told to stop when the broker holds their messages
   (:class:`compilesvc.compiles.unclaimed.UnclaimedWatch`, given by the relay loop, which keeps its state too).
6. Outbox rows not yet sent and due (including the requeues of step 1 and the re-sends of step 4): relayed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from compilesvc.compiles import leases
from compilesvc.compiles.publishing import publish_if_complete
from compilesvc.compiles.reconcile import Reconciler
from compilesvc.compiles.unclaimed import UnclaimedReport, UnclaimedWatch
from compilesvc.dispatch.outbox import OutboxRelay
from compilesvc.dispatch.registry import stale_workers
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile
from compilesvc.services import Services
from compilesvc.states import ArtifactState, BucketState
from compilesvc.store import StoreError

log = logging.getLogger(__name__)


@dataclass
class ReapReport:
    requeued: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    stale_workers: list[str] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    relayed: int = 0
    unclaimed: UnclaimedReport | None = None  # None: no watch given, or its pass failed

    @property
    def changed(self) -> bool:
        return bool(self.requeued or self.failed or self.cancelled or self.published or self.resent or self.relayed)


def expired_leases(session: Session, limit: int) -> list[int]:
    """Ids of running compiles whose lease ran out, oldest deadline first; rows another reaper is working
    on right now are skipped rather than waited for."""
    return list(session.scalars(
        select(BucketCompile.id)
        .where(BucketCompile.state == BucketState.RUNNING, BucketCompile.lease_expires_at < leases.lease_clock(session))
        .order_by(BucketCompile.lease_expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ))


def complete_unpublished(session: Session, limit: int) -> list[int]:
    """Artifacts still building whose every compile succeeded."""
    linked = (select(ArtifactBucket.bucket_compile_id)
              .where(ArtifactBucket.artifact_id == Artifact.id))
    unfinished = (
        select(ArtifactBucket.bucket_compile_id)
        .join(BucketCompile, BucketCompile.id == ArtifactBucket.bucket_compile_id)
        .where(ArtifactBucket.artifact_id == Artifact.id, BucketCompile.state != BucketState.SUCCEEDED)
    )
    return list(session.scalars(
        select(Artifact.id)
        .where(Artifact.state == ArtifactState.BUILDING, exists(linked), ~exists(unfinished))
        .order_by(Artifact.id)
        .limit(limit)
    ))


def reap(services: Services, *, relay: OutboxRelay | None = None, reconciler: Reconciler | None = None,
         watch: UnclaimedWatch | None = None, limit: int = 100) -> ReapReport:
    """One pass of every recovery step; returns what it did."""
    report = ReapReport()
    settings = services.settings
    relay = relay or services.relay

    # The scan only finds candidates (its locks end with its transaction). Each candidate is then handled
    # in its own transaction that takes the artifact locks before the compile's and re-checks the expiry,
    # so a worker renewing at the last moment keeps its compile.
    with transaction(services.sessions) as session:
        candidates = expired_leases(session, limit)
    for bucket_id in candidates:
        with transaction(services.sessions) as session:
            outcome = leases.expire(session, bucket_id)
        if outcome is None:
            continue
        log.warning("lease expired", extra={"bucket_compile_id": bucket_id, "bucket_key": outcome.bucket_key,
                                            "new_state": outcome.state})
        {BucketState.QUEUED: report.requeued, BucketState.FAILED: report.failed,
         BucketState.CANCELLED: report.cancelled}[outcome.state].append(bucket_id)

    with services.sessions() as session:
        stuck = complete_unpublished(session, limit)
    for artifact_id in stuck:
        try:
            published = publish_if_complete(services.store, services.sessions, artifact_id, signer=services.signer)
        except StoreError as exc:  # the store is down or a manifest is missing: try again next pass
            log.warning("artifact repair failed", extra={"artifact_id": artifact_id, "error": str(exc)})
            continue
        # Not when the worker that finished the last compile published it meanwhile (the usual race).
        if published:
            log.info("artifact published by the reaper", extra={"artifact_id": artifact_id})
            report.published.append(artifact_id)

    with services.sessions() as session:
        report.stale_workers = [w.id for w in stale_workers(session, settings.worker_stale_seconds)]

    if reconciler is not None:
        try:
            report.resent = reconciler.run()
        except Exception as exc:  # the broker is down: nothing can be concluded about its messages now
            log.warning("reconciler pass failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    if watch is not None:
        held = reconciler.held if reconciler is not None else None
        try:
            report.unclaimed = watch.run(held)
        except Exception as exc:  # the ledger hiccuped: the other steps' work stands, the next pass looks again
            log.warning("unclaimed-work pass failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    report.relayed = relay.relay_all(limit)
    return report
