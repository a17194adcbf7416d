"""The worker registry: which workers are alive, what they can compile and which queues they consume.

Workers register on start (:func:`register`), heartbeat while they run (:func:`heartbeat`), say when they
were told to stop (:func:`mark_draining`: they take no new compile, and keep heartbeating while their running
compiles finish or are handed back; a worker whose heartbeat finds ``draining_at`` set by another process
stops as one that stopped consuming does, :mod:`workers.liveness`) and announce a clean stop
(:func:`mark_stopped`). A worker that dies
without stopping simply ages out: readers consider only workers that heartbeated within
``worker_stale_seconds``. Submits consult :func:`served_queues` when ``require_live_worker`` is set, so
registration is what lets the service accept work — or a pool that scales from zero, named in
``scalable_queues``, whose scaler starts a worker once work waits.

Liveness here is about *capacity*, not about ownership of work: a compile belongs to whoever holds its
lease (:mod:`compilesvc.compiles.leases`), and the reaper recovers it when that lease runs out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from compilesvc.access.team_reads import EVERYTHING, Reader, compile_conditions
from compilesvc.ledger.models import BucketCompile, Worker, utcnow
from compilesvc.ledger.sql import upsert
from compilesvc.states import BucketState


def register(session: Session, worker_id: str, hostname: str, capabilities: dict[str, Any],
             queues: Sequence[str], slots: int) -> None:
    """Insert or refresh a worker's row (a restart under the same id starts a new life)."""
    now = utcnow()
    values = {"id": worker_id, "hostname": hostname, "capabilities": capabilities, "queues": list(queues),
              "slots": slots, "started_at": now, "heartbeat_at": now, "draining_at": None, "stopped_at": None}
    upsert(session, Worker, values, ["id"])


@dataclass(frozen=True)
class Beat:
    """A heartbeat that found the worker's row: whether someone set its ``draining_at`` (the worker itself on
    SIGTERM, or another process telling it to stop, e.g. the relay finding work it does not take)."""

    draining: bool


def heartbeat(session: Session, worker_id: str) -> Beat | None:
    """Refresh a worker's heartbeat; None when its row is gone or marked stopped (re-register then)."""
    row = session.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.stopped_at.is_(None))
        .values(heartbeat_at=utcnow())
        .returning(Worker.id, Worker.draining_at)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    return None if row is None else Beat(draining=row.draining_at is not None)


def mark_draining(session: Session, worker_id: str) -> None:
    session.execute(
        update(Worker).where(Worker.id == worker_id, Worker.draining_at.is_(None)).values(draining_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def mark_stopped(session: Session, worker_id: str) -> None:
    session.execute(
        update(Worker).where(Worker.id == worker_id).values(stopped_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def live_workers(session: Session, stale_seconds: int) -> list[Worker]:
    """Workers that heartbeated within ``stale_seconds`` and have not announced a stop."""
    cutoff = utcnow() - timedelta(seconds=stale_seconds)
    return list(session.scalars(
        select(Worker).where(Worker.heartbeat_at >= cutoff, Worker.stopped_at.is_(None)).order_by(Worker.id)
    ))


def stale_workers(session: Session, stale_seconds: int) -> list[Worker]:
    """Workers that went silent without announcing a stop (crashed, partitioned, or frozen)."""
    cutoff = utcnow() - timedelta(seconds=stale_seconds)
    return list(session.scalars(
        select(Worker).where(Worker.heartbeat_at < cutoff, Worker.stopped_at.is_(None)).order_by(Worker.id)
    ))


def live_queues(session: Session, stale_seconds: int) -> set[str]:
    """The queues live workers will take work from: a draining one takes none (it is still listed as live)."""
    return {queue for worker in live_workers(session, stale_seconds) if worker.draining_at is None
            for queue in worker.queues}


def served_queues(session: Session, stale_seconds: int, scalable: Iterable[str] = ()) -> set[str]:
    """The queues whose compiles will be taken: those live workers read, and those a pool that scales from zero
    serves (``COMPILESVC_SCALABLE_QUEUES``: its scaler counts queued compiles and starts a worker, so with
    none alive the work is still served). Every check of "served" reads this one set."""
    return live_queues(session, stale_seconds) | set(scalable)


@dataclass(frozen=True)
class QueueDepth:
    """One queue: its live consumers and the compiles waiting on it or running from it."""

    name: str
    live_workers: int
    queued: int
    running: int
    oldest_queued_at: datetime | None

    @property
    def unserved(self) -> bool:
        """Work is waiting and no live worker reads the queue: it waits until one registers."""
        return self.live_workers == 0 and self.queued > 0


@dataclass(frozen=True)
class RunningCompile:
    compile_id: int
    worker_id: str
    build_id: int | None  # the build that queued it
    inputs: list[Any]
    target: str
    sdk: str
    started_at: datetime | None
    attempts: int


def queue_depths(session: Session, live: Sequence[Worker]) -> list[QueueDepth]:
    """Every queue that has a live consumer or compiles queued or running, by name."""
    consumers: dict[str, int] = {}
    for worker in live:
        if worker.draining_at is not None:  # takes no new compile: not a consumer of what waits
            continue
        for name in worker.queues:
            consumers[name] = consumers.get(name, 0) + 1
    counts: dict[str, dict[str, Any]] = {}
    for name, state, count, oldest in session.execute(
        select(BucketCompile.queue, BucketCompile.state, func.count(), func.min(BucketCompile.queued_at))
        .where(BucketCompile.state.in_((BucketState.QUEUED, BucketState.RUNNING)))
        .group_by(BucketCompile.queue, BucketCompile.state)
    ):
        entry = counts.setdefault(name, {})
        entry[state] = count
        if state == BucketState.QUEUED:
            entry["oldest"] = oldest
    return [QueueDepth(name, consumers.get(name, 0), counts.get(name, {}).get(BucketState.QUEUED, 0),
                       counts.get(name, {}).get(BucketState.RUNNING, 0), counts.get(name, {}).get("oldest"))
            for name in sorted(consumers.keys() | counts.keys())]


def running_compiles(session: Session, reader: Reader = EVERYTHING) -> dict[str, list[RunningCompile]]:
    """What each worker is compiling now, by worker id (the lease holder of every running compile), of the
    compiles ``reader`` may read (:mod:`compilesvc.access.team_reads`)."""
    found: dict[str, list[RunningCompile]] = {}
    for bucket in session.scalars(select(BucketCompile).where(BucketCompile.state == BucketState.RUNNING,
                                                              *compile_conditions(reader, BucketCompile.id))
                                  .order_by(BucketCompile.started_at)):
        if bucket.worker_id is None:
            continue
        found.setdefault(bucket.worker_id, []).append(RunningCompile(
            bucket.id, bucket.worker_id, bucket.origin_build_id, bucket.inputs, bucket.target, bucket.sdk,
            bucket.started_at, bucket.attempts))
    return found
