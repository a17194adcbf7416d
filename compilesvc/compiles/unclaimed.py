"""Work nobody takes: compiles dispatched to a queue and left unclaimed while a worker of that queue sits idle,
and telling that worker to stop (the relay's reaper runs it every pass; :class:`UnclaimedWatch`).

A worker can be registered and heartbeating and yet no longer take messages: its broker client wedged after a
reconnection (celery/celery#10302, #10205, #9054, #8030). Its queue then fills while it idles. The rule, which
separates that from a long queue, a lost message and a broker outage:

* **unclaimed**: a compile ``queued`` whose every dispatch was sent, the latest at least ``unclaimed_after``
  ago (``COMPILESVC_UNCLAIMED_AFTER_SECONDS``). A message the broker lost is re-sent by the reconciler
  (:mod:`compilesvc.compiles.reconcile`) after about two ``dispatch_grace_seconds``, and a re-send restarts
  the clock: only a re-send that is itself left unclaimed for the whole bound counts.
* **idle worker**: registered, heartbeating within ``worker_stale_seconds``, not draining, with a free slot
  (fewer running compiles than its ``slots``), and idle for the whole bound: no claim, no finish and no change
  of its running compiles since. "Since" is the latest of its registration, its running compiles' claims, its
  last finish (``finished_at``) and the first pass in which *this* relay saw it with a free slot and the same
  running compiles (a requeue leaves no ``finished_at``; a relay that just started has seen nothing yet). A
  busy pool is not stuck: a worker whose slots are all taken is never idle, and one that just finished is
  idle for a moment only.
* a queue is **stuck** while it has unclaimed compiles and an idle worker serving it: reported (a log line when
  it starts and when it ends; gauges per queue). An idle worker with a free slot would have taken a message
  waiting in its queue within milliseconds, so every idle worker of a stuck queue is failing to consume.
* such a worker is **told to stop** (``workers.draining_at``; the worker's heartbeat thread reads it, stops
  advertising, finishes what runs and exits non-zero for its supervisor to restart it) only with evidence that
  the broker holds the message: the reconciler read the broker in this same pass and found at least one of
  the queue's unclaimed compiles there (waiting, or delivered within the claim window). Without that (the
  broker down, or a broker the reconciler cannot read) the cause may well be the broker, a restart would
  not help, and the queue is only reported.

Every step is safe from several relays at once: telling is one conditional ``UPDATE`` (not draining yet, the
same life, nothing claimed since it was seen idle), so a worker is told once and counted by the relay that
told it. Queries: the alive workers by ``ix_workers_heartbeat_at``; running compiles and queued rows by the
partial ``ix_bucket_compiles_active_queue`` (active rows only, whatever the history); recent finishes by
``ix_bucket_compiles_finished_at``; each compile's dispatches by ``ix_outbox_bucket_compile_id_id``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, case, exists, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import BucketCompile, Outbox, Worker, utcnow
from compilesvc.states import BucketState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StuckQueue:
    """A queue whose dispatched compiles sit unclaimed while workers serving it idle."""

    name: str
    unclaimed: int
    oldest_sent_at: datetime
    idle_workers: tuple[str, ...]
    held: int  # of the unclaimed, how many the broker was seen holding this pass (0: not known)

    def oldest_age(self, now: datetime) -> float:
        return max(0.0, (now - self.oldest_sent_at).total_seconds())


@dataclass
class UnclaimedReport:
    served: set[str] = field(default_factory=set)  # queues with an alive, non-draining worker
    stuck: dict[str, StuckQueue] = field(default_factory=dict)
    told: list[str] = field(default_factory=list)  # workers this relay set draining_at on, this pass
    at: datetime = field(default_factory=utcnow)


@dataclass(frozen=True)
class _Alive:
    id: str
    queues: tuple[str, ...]
    slots: int
    started_at: datetime
    running: frozenset[int]
    last_claim: datetime | None


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def running_of(worker_ids: Collection[str]) -> Select[str | None, int, datetime | None]:
    """``(worker_id, id, started_at)`` of the compiles these workers are running."""
    return (select(BucketCompile.worker_id, BucketCompile.id, BucketCompile.started_at)
            .where(BucketCompile.state == BucketState.RUNNING, BucketCompile.worker_id.in_(sorted(worker_ids))))


def last_finishes(worker_ids: Collection[str], since: datetime) -> Select[str | None, datetime | None]:
    """``(worker_id, latest finished_at)`` of these workers' compiles finished since ``since``."""
    return (select(BucketCompile.worker_id, func.max(BucketCompile.finished_at))
            .where(BucketCompile.finished_at >= since, BucketCompile.worker_id.in_(sorted(worker_ids)))
            .group_by(BucketCompile.worker_id))


def unclaimed_by_queue(queues: Collection[str], cutoff: datetime, held: Collection[int] | None) -> Select[Any]:
    """Per queue of ``queues``: how many queued compiles had every dispatch sent before ``cutoff``, the oldest
    latest send, and how many of them are in ``held``. Reads queued rows through the partial index of active
    compiles and each one's dispatches through the outbox's (bucket_compile_id, id) index."""
    # Correlated per queued row, both by the outbox's index: an anti-join would be planned as one pass over
    # the whole outbox, which keeps every dispatch ever sent.
    mine = Outbox.bucket_compile_id == BucketCompile.id
    last_sent = select(func.max(Outbox.sent_at)).where(mine).scalar_subquery()
    unsent = select(func.count()).where(mine, Outbox.sent_at.is_(None)).scalar_subquery()
    rows = (
        select(BucketCompile.queue.label("queue"), last_sent.label("sent_at"), unsent.label("unsent"),
               case((BucketCompile.id.in_(sorted(held or ())), 1), else_=0).label("held"))
        .where(BucketCompile.state == BucketState.QUEUED, BucketCompile.queue.in_(sorted(queues)))
        .subquery()
    )
    return (select(rows.c.queue, func.count(), func.min(rows.c.sent_at), func.sum(rows.c.held))
            .where(rows.c.unsent == 0, rows.c.sent_at < cutoff).group_by(rows.c.queue).order_by(rows.c.queue))


class UnclaimedWatch:
    """One per relay process: it remembers across passes since when it has seen each worker idle."""

    def __init__(self, sessions: sessionmaker[Session], *, unclaimed_after: float, stale_seconds: float,
                 clock: Callable[[], datetime] = utcnow):
        self._sessions = sessions
        self._bound = timedelta(seconds=unclaimed_after)
        self._stale = timedelta(seconds=stale_seconds)
        self._clock = clock
        self._seen_free: dict[str, tuple[frozenset[int], datetime]] = {}
        self._reported: set[str] = set()

    def run(self, held: Collection[int] | None) -> UnclaimedReport:
        """One pass. ``held``: the ids of compiles the reconciler saw the broker hold in this pass, or None
        when the broker was not read (then nothing is told, only reported)."""
        now = self._clock()
        report = UnclaimedReport(at=now)
        with self._sessions() as session:
            alive = self._alive(session, now)
            report.served = {q for worker in alive for q in worker.queues}
            finished = self._last_finishes(session, [w.id for w in alive], now)
            idle = self._idle(alive, finished, now)
            if idle:
                queues = {q for worker in idle for q in worker.queues}
                for name, count, oldest, held_count in self._unclaimed(session, queues, now, held):
                    workers = tuple(sorted(w.id for w in idle if name in w.queues))
                    report.stuck[name] = StuckQueue(name, count, _aware(oldest), workers, held_count)
        self._log_changes(report, now)
        by_id = {w.id: w for w in alive}
        told: set[str] = set()
        for queue in report.stuck.values():
            if held is None or not queue.held:
                continue
            for worker_id in queue.idle_workers:
                if worker_id not in told and self._tell(by_id[worker_id], queue, now):
                    told.add(worker_id)
        report.told = sorted(told)
        return report

    # -- what the ledger says -------------------------------------------------------------------------------

    def _alive(self, session: Session, now: datetime) -> list[_Alive]:
        workers = session.scalars(select(Worker).where(
            Worker.heartbeat_at >= now - self._stale, Worker.stopped_at.is_(None), Worker.draining_at.is_(None)
        ).order_by(Worker.id)).all()
        if not workers:
            return []
        running: dict[str, list[tuple[int, datetime | None]]] = {}
        for worker_id, bucket_id, started_at in session.execute(running_of([w.id for w in workers])):
            running.setdefault(str(worker_id), []).append((bucket_id, started_at))
        alive = []
        for worker in workers:
            mine = running.get(worker.id, [])
            claims = [_aware(at) for _, at in mine if at is not None]
            alive.append(_Alive(worker.id, tuple(str(q) for q in worker.queues), worker.slots,
                                _aware(worker.started_at), frozenset(i for i, _ in mine),
                                max(claims) if claims else None))
        return alive

    def _last_finishes(self, session: Session, worker_ids: list[str], now: datetime) -> dict[str, datetime]:
        """Each worker's latest finish within the bound (an older one cannot make it less idle than the bound)."""
        if not worker_ids:
            return {}
        return {str(worker_id): _aware(at) for worker_id, at in session.execute(
            last_finishes(worker_ids, now - self._bound)) if at is not None}

    def _idle(self, alive: list[_Alive], finished: dict[str, datetime], now: datetime) -> list[_Alive]:
        seen: dict[str, tuple[frozenset[int], datetime]] = {}
        idle = []
        for worker in alive:
            if len(worker.running) >= worker.slots:
                continue  # busy: it cannot take a message, so it proves nothing
            previous = self._seen_free.get(worker.id)
            first = previous[1] if previous is not None and previous[0] == worker.running else now
            seen[worker.id] = (worker.running, first)
            since = max(first, worker.started_at, *(t for t in (worker.last_claim, finished.get(worker.id)) if t))
            if now - since >= self._bound:
                idle.append(worker)
        self._seen_free = seen
        return idle

    def _unclaimed(self, session: Session, queues: Collection[str], now: datetime,
                   held: Collection[int] | None) -> list[tuple[str, int, datetime, int]]:
        return [(name, int(count), sent, int(held_count or 0)) for name, count, sent, held_count
                in session.execute(unclaimed_by_queue(queues, now - self._bound, held))]

    # -- what the relay does ----------------------------------------------------------------------------------

    def _tell(self, worker: _Alive, queue: StuckQueue, now: datetime) -> bool:
        """Set the worker's ``draining_at`` unless another relay did, it restarted, or it claimed meanwhile."""
        claimed_since = select(BucketCompile.id).where(
            BucketCompile.state == BucketState.RUNNING, BucketCompile.worker_id == worker.id,
            BucketCompile.id.not_in(sorted(worker.running)))
        with transaction(self._sessions) as session:
            told = session.execute(
                update(Worker)
                .where(Worker.id == worker.id, Worker.draining_at.is_(None), Worker.stopped_at.is_(None),
                       Worker.started_at == worker.started_at, Worker.heartbeat_at >= now - self._stale,
                       ~exists(claimed_since))
                .values(draining_at=utcnow())
                .returning(Worker.id)
                .execution_options(synchronize_session=False)
            ).scalar_one_or_none()
        if told is None:
            return False
        log.warning("told a worker to stop: it takes no work", extra={
            "worker": worker.id, "queue": queue.name, "unclaimed": queue.unclaimed,
            "oldest_age_seconds": round(queue.oldest_age(now), 1), "held_by_broker": queue.held,
            "reason": (f"{queue.unclaimed} compile(s) dispatched to {queue.name} at least "
                       f"{self._bound.total_seconds():g}s ago sat unclaimed while this worker had a free slot "
                       f"and claimed nothing for as long; the broker holds their messages"),
        })
        return True

    def _log_changes(self, report: UnclaimedReport, now: datetime) -> None:
        """A line when a queue becomes stuck and one when it is not any longer; not one every pass."""
        for name in sorted(report.stuck.keys() - self._reported):
            queue = report.stuck[name]
            log.warning("compiles dispatched and not claimed", extra={
                "queue": name, "unclaimed": queue.unclaimed, "oldest_age_seconds": round(queue.oldest_age(now), 1),
                "idle_workers": list(queue.idle_workers), "held_by_broker": queue.held,
                "unclaimed_after_seconds": self._bound.total_seconds()})
        for name in sorted(self._reported - report.stuck.keys()):
            # Claimed, cancelled, or its idle workers told to stop (a queue nobody serves is admission's case).
            log.info("unclaimed compiles no longer reported", extra={"queue": name, "served": name in report.served})
        self._reported = set(report.stuck)
