"""Fenced leases on bucket compiles: the only code that moves a compile into or out of ``running``.

A worker *claims* a queued compile with one conditional ``UPDATE … WHERE state='queued' RETURNING``, which
bumps ``lease_token`` and sets a deadline. From then on every write it makes carries that token: renewals
(:func:`renew`), the success record (:func:`succeed`) and the failure record (:func:`fail`). Anything that
takes a compile away from a worker (the reaper on an expired lease, a requeue, a cancel of a queued
compile) bumps the token too, so a worker that was paused, partitioned or merely slow finds that its
writes match zero rows, and stops. That, not Celery's delivery guarantees, is what makes a compile run to
completion at most once per dispatch and recorded exactly once.

Lease deadlines are written and judged by the database's clock on Postgres (workers and the reaper run on
different hosts; their clocks must not decide who owns a lease), and by the process clock on SQLite, which
only serves a single host.

Lock order, shared with submit and cancel: the artifacts containing a compile first, then the compile.
Every transition records an ``events`` row in the same transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from compilesvc.compiles import failures
from compilesvc.compiles.bucket_compiles import requeue_bucket
from compilesvc.compiles.failures import ArchivedLog, Phase
from compilesvc.config.settings import DEFAULT_UNKNOWN_FAILURE_RETRIES
from compilesvc.ledger import events
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, BucketFailure, utcnow
from compilesvc.lifecycle.artifacts import fail_artifacts_of_bucket
from compilesvc.states import RETRIED, ArtifactState, BucketState, ErrorClass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """What a worker needs to run one attempt of a bucket compile, and the token fencing its writes."""

    bucket_id: int
    key: str
    token: int
    attempt: int
    max_attempts: int
    target: str
    sdk: str
    backend: str
    model: dict[str, Any]
    material: dict[str, Any]
    inputs: list[Any]
    lease_expires_at: datetime
    interruptions: int = 0

    @property
    def counted(self) -> int:
        """This attempt's number among those that count against ``max_attempts`` (interrupted ones do not)."""
        return self.attempt - self.interruptions


@dataclass(frozen=True)
class Renewal:
    still_ours: bool
    cancel_requested: bool


@dataclass(frozen=True)
class Outcome:
    """Where a failed or expired attempt left the compile; ``outbox_id`` is set when it was requeued and
    the caller should relay that row after committing."""

    state: BucketState  # queued | failed | cancelled
    bucket_key: str
    outbox_id: int | None = None
    retry_in: float = 0.0  # seconds before the requeued attempt is sent (the backoff)


def lease_clock(session: Session) -> ColumnElement[datetime] | datetime:
    """The clock lease deadlines are written and judged by: the database's where there is one to share."""
    if session.get_bind().dialect.name == "postgresql":
        return func.now()
    return utcnow()


def _deadline(session: Session, seconds: float) -> ColumnElement[datetime] | datetime:
    return lease_clock(session) + timedelta(seconds=seconds)


def claim(session: Session, bucket_id: int, worker_id: str, lease_seconds: float) -> Claim | None:
    """Take a queued compile for one attempt; None when there is nothing to claim.

    None covers every reason a delivered message must not run: a duplicate delivery of a message whose
    compile is already running or done, a compile cancelled while queued, or one that no longer exists.
    """
    now = lease_clock(session)
    row = session.execute(
        update(BucketCompile)
        .where(BucketCompile.id == bucket_id, BucketCompile.state == BucketState.QUEUED)
        .values(
            state=BucketState.RUNNING,
            lease_token=BucketCompile.lease_token + 1,
            lease_expires_at=_deadline(session, lease_seconds),
            worker_id=worker_id,
            attempts=BucketCompile.attempts + 1,
            started_at=now,
            finished_at=None,
            cancel_requested=False,
            error_class=None,
            error_code=None,
            error_message=None,
        )
        .returning(
            BucketCompile.key, BucketCompile.lease_token, BucketCompile.attempts, BucketCompile.max_attempts,
            BucketCompile.target, BucketCompile.sdk, BucketCompile.backend, BucketCompile.model,
            BucketCompile.material, BucketCompile.inputs, BucketCompile.lease_expires_at,
            BucketCompile.interruptions,
        )
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return None
    events.record(session, "bucket", bucket_id, BucketState.QUEUED, BucketState.RUNNING, worker=worker_id,
                  attempt=row.attempts, token=row.lease_token)
    return Claim(bucket_id=bucket_id, key=row.key, token=row.lease_token, attempt=row.attempts,
                 max_attempts=row.max_attempts, target=row.target, sdk=row.sdk, backend=row.backend,
                 model=row.model, material=row.material, inputs=row.inputs,
                 lease_expires_at=row.lease_expires_at, interruptions=row.interruptions)


def renew(session: Session, bucket_id: int, token: int, lease_seconds: float) -> Renewal:
    """Extend the lease; reports whether it is still ours and whether a cancel was requested.

    A lease that ran out but was not yet taken back by the reaper can still be renewed: expiry only
    makes a compile *eligible* for recovery, the token bump is what takes it away.
    """
    cancel = session.execute(
        update(BucketCompile)
        .where(BucketCompile.id == bucket_id, BucketCompile.lease_token == token,
               BucketCompile.state == BucketState.RUNNING)
        .values(lease_expires_at=_deadline(session, lease_seconds))
        .returning(BucketCompile.cancel_requested)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if cancel is None:
        return Renewal(still_ours=False, cancel_requested=False)
    return Renewal(still_ours=True, cancel_requested=bool(cancel))


def succeed(session: Session, bucket_id: int, token: int, manifest_uri: str, versions: dict[str, Any],
            compile_seconds: float | None) -> bool:
    """Record a published bucket manifest; False when the lease was lost (another attempt owns it now).

    A cancel requested meanwhile does not stop a finished compile from counting: the manifest is in the
    store already, and the next submit of the same bucket is served from it.
    """
    done = session.execute(
        update(BucketCompile)
        .where(BucketCompile.id == bucket_id, BucketCompile.lease_token == token,
               BucketCompile.state == BucketState.RUNNING)
        .values(state=BucketState.SUCCEEDED, manifest_uri=manifest_uri, versions=versions,
                compile_seconds=compile_seconds, finished_at=utcnow(), lease_expires_at=None,
                cancel_requested=False, error_class=None, error_code=None, error_message=None)
        .returning(BucketCompile.attempts)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if done is None:
        return False
    events.record(session, "bucket", bucket_id, BucketState.RUNNING, BucketState.SUCCEEDED, attempt=done,
                  token=token)
    return True


def _lock_artifacts(session: Session, bucket_id: int) -> list[Artifact]:
    """Lock the artifacts containing a compile, in id order, before the compile itself (the lock order
    submit and cancel use; taking them the other way round would deadlock against a concurrent cancel)."""
    return list(session.scalars(
        select(Artifact)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == Artifact.id)
        .where(ArtifactBucket.bucket_compile_id == bucket_id)
        .order_by(Artifact.id)
        .with_for_update(of=Artifact)
    ))


def fail(session: Session, bucket_id: int, token: int, error_class: ErrorClass | str, code: str | None,
         message: str | None, *, phase: str = Phase.COMPILE, backoff_seconds: float = 0.0,
         unknown_retries: int = DEFAULT_UNKNOWN_FAILURE_RETRIES, archived: ArchivedLog | None = None,
         retry_once: str | None = None) -> Outcome | None:
    """Record a failed attempt; None when the lease was lost.

    - ``compile`` / ``bad_request``: final. The compile stays failed (the negative cache) and so do the sets
      containing it. Except a ``compile`` error with ``retry_once`` (why its code may be non-deterministic on
      this release, :func:`workers.compiling.error_codes.for_release`): requeued once per round of attempts while
      attempts remain, and final (negatively cached) when the same code comes back.
    - ``infra`` / ``timeout``: requeued, to be sent after ``backoff_seconds``, while ``attempts <
      max_attempts`` and the failure is not the previous attempt's repeated identically (class, code and
      message: a deterministic failure in disguise, which another attempt would only repeat); else failed.
    - ``unknown``: requeued like infra while fewer than ``unknown_retries`` unknown failures were retried
      in this round of attempts (rounds start at a resubmit or explicit retry; an identical repeat is retried
      too: the bound is the limit here),
      then failed as ``unknown`` with a message saying so; never the negative cache.
    - ``cancelled``: cancelled, unless someone still wants the compile (a submit reopened a set
      containing it while the cancel was in flight), in which case it is requeued.

    Every failure is added to the compile's history (:mod:`compilesvc.compiles.failures`), with the attempt's
    ``archived`` log when the worker stored it. The token check and the
    write happen under one row lock, so they are as atomic as a conditional UPDATE; the lock is taken
    after those of the artifacts (see :func:`_lock_artifacts`).
    """
    error_class = ErrorClass(error_class)
    artifacts = _lock_artifacts(session, bucket_id)
    bucket = _held(session, bucket_id, token)
    if bucket is None:
        return None
    return _settle_attempt(session, bucket, artifacts, error_class, code, message, phase=phase,
                           backoff_seconds=backoff_seconds, unknown_retries=unknown_retries, archived=archived,
                           retry_once=retry_once)


#: Hand-backs that do not count against ``max_attempts``; past them each counts as an infrastructure failure
#: (a compile longer than every worker's life, on a pool that keeps scaling in, would otherwise loop forever).
FREE_INTERRUPTIONS = 5


def interrupt(session: Session, bucket_id: int, token: int, why: str) -> Outcome | None:
    """Give a running compile back to the queue at once, its attempt not counted: its worker is draining
    (told to stop, or its instance is being reclaimed) and the compile did not fit in the drain window. None
    when the lease was lost.

    The attempt keeps its number (its log lines stay its own), and ``interruptions`` grows by one, so the
    retry budget (:func:`fail`) counts only attempts that ran their course, for the first
    :data:`FREE_INTERRUPTIONS`; later ones count as infrastructure failures. A compile whose cancel was
    requested meanwhile is cancelled instead: no one wants it back.
    """
    artifacts = _lock_artifacts(session, bucket_id)
    bucket = _held(session, bucket_id, token)
    if bucket is None:
        return None
    if bucket.cancel_requested:
        return _settle_attempt(session, bucket, artifacts, ErrorClass.CANCELLED, "CANCELLED",
                               f"cancelled; {why}", phase=Phase.WORKER, backoff_seconds=0.0, unknown_retries=0)
    if bucket.interruptions >= FREE_INTERRUPTIONS:  # a compile longer than any worker lives: the budget decides
        return _settle_attempt(session, bucket, artifacts, ErrorClass.INFRA, "INTERRUPTED",
                               f"interrupted {bucket.interruptions + 1} times: {why}", phase=Phase.WORKER,
                               backoff_seconds=0.0, unknown_retries=0)
    bucket.interruptions += 1
    reason = f"interrupted: {why}; attempt {bucket.attempts} not counted"
    outbox_id = requeue_bucket(session, bucket, reason, reset_attempts=False)
    log.info("bucket compile interrupted and requeued", extra={"bucket_compile_id": bucket.id,
                                                               "bucket_key": bucket.key, "reason": reason})
    return Outcome(BucketState.QUEUED, bucket.key, outbox_id)


def _held(session: Session, bucket_id: int, token: int) -> BucketCompile | None:
    """The running compile whose lease ``token`` still holds, locked; None when the lease was lost."""
    return session.scalars(
        select(BucketCompile)
        .where(BucketCompile.id == bucket_id, BucketCompile.lease_token == token,
               BucketCompile.state == BucketState.RUNNING)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()


def expire(session: Session, bucket_id: int) -> Outcome | None:
    """Take back a running compile whose lease ran out (the reaper's step); None if it is not (any
    longer) expired, or another reaper holds it.

    The compile is requeued at once while attempts remain (the token bump fences off the silent worker;
    another worker may well be healthy), else failed as ``infra`` with code ``LEASE_EXPIRED``. A compile
    whose cancel was requested when its worker went silent is cancelled.
    """
    artifacts = _lock_artifacts(session, bucket_id)
    bucket = session.scalars(
        select(BucketCompile)
        .where(BucketCompile.id == bucket_id, BucketCompile.state == BucketState.RUNNING,
               BucketCompile.lease_expires_at < lease_clock(session))
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).one_or_none()
    if bucket is None:
        return None
    worker = bucket.worker_id
    if bucket.cancel_requested:
        error_class, code = ErrorClass.CANCELLED, "CANCELLED"
        message = f"cancelled; worker {worker} stopped renewing its lease"
    else:
        error_class, code = ErrorClass.INFRA, "LEASE_EXPIRED"
        message = f"worker {worker} stopped renewing its lease (attempt {bucket.attempts})"
    return _settle_attempt(session, bucket, artifacts, error_class, code, message, reason="lease expired",
                           phase=Phase.LEASE, backoff_seconds=0.0, unknown_retries=0)  # never unknown


def _repeats_previous(session: Session, bucket: BucketCompile, phase: str, error_class: ErrorClass,
                      code: str | None, message: str | None) -> int | None:
    """The attempt whose failure this one repeats exactly: the last one that failed, if the compiler failed it
    the same way (attempts a draining worker handed back, which leave no failure, do not separate them); else
    None. Only the compiler's own failures count: an outage (of the store, the ledger, a worker) reads the same
    every time it lasts, and is what the retries exist for."""
    if phase != Phase.COMPILE:
        return None
    previous = failures.latest_before(session, bucket.id, attempt=bucket.attempts, attempt_round=bucket.attempt_round)
    # Compared as stored: the history keeps a long message shortened.
    if previous is not None and previous.phase == Phase.COMPILE and (
            previous.error_class, previous.code, previous.message) == (
            error_class, code, None if message is None else failures.shorten(message)):
        return previous.attempt
    return None


def _earlier_unknown_failures(session: Session, bucket: BucketCompile) -> int:
    """Unknown failures of the compile's earlier attempts in this round (since its attempts were last reset
    by a resubmit or an explicit retry)."""
    row = BucketFailure.__table__.c
    return int(session.scalar(
        select(func.count()).select_from(BucketFailure.__table__)
        .where(row.bucket_compile_id == bucket.id, row.error_class == ErrorClass.UNKNOWN,
               row.attempt_round == bucket.attempt_round, row.attempt < bucket.attempts)) or 0)


def _retried_once_before(session: Session, bucket: BucketCompile) -> bool:
    """Whether an earlier attempt of this round already had its one retry for a compile error (any code: an
    NCC_CFG015 then an NCC_CFG016 is one rule's second chance, not two). A compile error is retried for no
    other reason."""
    row = BucketFailure.__table__.c
    return bool(session.scalar(
        select(func.count()).select_from(BucketFailure.__table__)
        .where(row.bucket_compile_id == bucket.id, row.error_class == ErrorClass.COMPILE, row.retry.is_(True),
               row.attempt_round == bucket.attempt_round, row.attempt < bucket.attempts)))


def _settle_attempt(session: Session, bucket: BucketCompile, artifacts: list[Artifact], error_class: ErrorClass,
                    code: str | None, message: str | None, *, phase: str, backoff_seconds: float,
                    unknown_retries: int, reason: str | None = None, archived: ArchivedLog | None = None,
                    retry_once: str | None = None) -> Outcome:
    wanted = any(a.state == ArtifactState.BUILDING for a in artifacts)
    attempt = bucket.attempts
    counted = bucket.attempts - bucket.interruptions  # what the budget sees (interrupted attempts are free)
    if error_class == ErrorClass.CANCELLED and (wanted or not bucket.cancel_requested):
        # The cancel lost a race with a resubmit or retry (which clear cancel_requested / reopen the set):
        # the compile is wanted again, so it goes back to the queue rather than to a dead end.
        outbox_id = requeue_bucket(session, bucket, "cancel superseded by a new request", reset_attempts=False)
        return Outcome(BucketState.QUEUED, bucket.key, outbox_id)
    unknown = error_class == ErrorClass.UNKNOWN
    repeated = (_repeats_previous(session, bucket, phase, error_class, code, message)
                if error_class in RETRIED and not unknown else None)
    retried_unknowns = _earlier_unknown_failures(session, bucket) if unknown else 0
    suspect = bool(retry_once) and error_class == ErrorClass.COMPILE
    recurred = suspect and _retried_once_before(session, bucket)
    retry = (error_class in RETRIED and counted < bucket.max_attempts and repeated is None
             and (not unknown or retried_unknowns < unknown_retries))
    if suspect and not recurred and counted < bucket.max_attempts:
        retry = True
        reason = reason or f"compile error {code}, retried once: {retry_once}"
    message_of_record = message
    if recurred:
        message_of_record = f"{code} again after one retry ({retry_once}), so final: {message}"
    elif repeated is not None:
        message_of_record = f"the same failure as attempt {repeated}, so not retried again: {message}"
    elif unknown and not retry:
        message_of_record = (f"no diagnosis after {retried_unknowns + 1} unknown failure(s) "
                             f"({retried_unknowns} retried; attempt {counted} of {bucket.max_attempts}): {message}")
    if error_class != ErrorClass.CANCELLED:
        failures.record(session, bucket.id, attempt, phase, error_class, code, message, retry=retry, log=archived)
    if retry:
        outbox_id = requeue_bucket(
            session, bucket, reason or f"{error_class} error, attempt {counted} of {bucket.max_attempts}",
            reset_attempts=False, delay_seconds=backoff_seconds,
        )
        log.info("bucket compile requeued", extra={"bucket_compile_id": bucket.id, "bucket_key": bucket.key,
                                                   "attempt": attempt, "error_class": error_class,
                                                   "retry_in": round(backoff_seconds, 1)})
        return Outcome(BucketState.QUEUED, bucket.key, outbox_id, retry_in=backoff_seconds)
    state = BucketState.CANCELLED if error_class == ErrorClass.CANCELLED else BucketState.FAILED
    events.record(session, "bucket", bucket.id, bucket.state, state, error_class=error_class, code=code,
                  attempt=attempt, **({"reason": reason} if reason else {}))
    bucket.state = state
    bucket.error_class = error_class
    bucket.error_code = code
    bucket.error_message = None if message_of_record is None else failures.shorten(message_of_record)
    bucket.finished_at = utcnow()
    bucket.lease_expires_at = None
    bucket.cancel_requested = False
    bucket.lease_token += 1  # nobody's writes count after a final state
    if state == BucketState.FAILED:
        session.flush()
        fail_artifacts_of_bucket(session, bucket)
    return Outcome(state, bucket.key)
