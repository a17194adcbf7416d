"""The transactional outbox relay: sends committed dispatch rows to Celery and marks them sent.

The submit transaction writes ``outbox`` rows next to the compile rows they announce. After commit,
whoever wrote rows sends them at once through :meth:`OutboxRelay.after_commit` (submit, retry, a worker
requeueing a failed attempt): low latency, and a broker that is down costs nothing but the wait, because
the relay loop (``compilesvc relay``, :meth:`OutboxRelay.relay_all`) sends whatever is left behind.
Delivery is at least once; the worker's lease claim makes a second delivery a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.dispatch.routing import COMPILE_TASK, task_id
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import BucketCompile, Outbox, utcnow

log = logging.getLogger(__name__)


class Producer(Protocol):
    def send_task(self, name: str, args: object = ..., kwargs: object = ..., **options: object) -> object: ...


class OutboxRelay:
    """Sends committed, due outbox rows through a Celery producer and marks them sent."""

    def __init__(self, sessions: sessionmaker[Session], producer: Producer):
        self._sessions = sessions
        self._producer = producer

    def relay(self, ids: Sequence[int] | None = None, limit: int = 200) -> int:
        """Send unsent rows (only ``ids`` if given); returns how many were sent.

        Rows are locked with SKIP LOCKED so several relays (API processes, the relay loop) never send
        the same row concurrently. A broker error stops the batch; the rows stay unsent for the next pass.
        """
        if ids is not None and not ids:
            return 0
        sent = 0
        with transaction(self._sessions) as session:
            query = (select(Outbox, BucketCompile.key)
                     .join(BucketCompile, BucketCompile.id == Outbox.bucket_compile_id)
                     .where(Outbox.sent_at.is_(None),
                            or_(Outbox.available_at.is_(None), Outbox.available_at <= utcnow()))
                     .order_by(Outbox.id).limit(limit))
            if ids is not None:
                query = query.where(Outbox.id.in_(list(ids)))
            rows = session.execute(query.with_for_update(of=Outbox, skip_locked=True)).all()
            for row, bucket_key in rows:
                ids_of_row = {"outbox_id": row.id, "bucket_compile_id": row.bucket_compile_id,
                              "bucket_key": bucket_key, "task_id": row.task_id}
                try:
                    self._producer.send_task(row.task_name, kwargs=row.kwargs, task_id=row.task_id)
                except Exception as exc:  # broker down: keep the row, report, try again next pass
                    row.send_attempts += 1
                    row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
                    log.warning("outbox send failed", extra={**ids_of_row, "error": row.last_error})
                    break
                row.sent_at = utcnow()
                row.send_attempts += 1
                sent += 1
                log.info("compile dispatched", extra=ids_of_row)
        return sent

    def after_commit(self, ids: Sequence[int], **context: object) -> int:
        """Send rows the caller has just committed; never raises. A failure (broker or ledger away) is
        logged with ``context``: the rows are durable, and the relay loop sends them."""
        try:
            return self.relay(ids)
        except Exception as exc:
            log.warning("post-commit relay failed; the relay loop will send it",
                        extra={**context, "outbox_ids": list(ids), "error": f"{type(exc).__name__}: {exc}"})
            return 0

    def relay_all(self, batch: int = 200) -> int:
        """Send unsent due rows until none are left or the broker refuses one (the relay loop's pass)."""
        total = 0
        while True:
            sent = self.relay(limit=batch)
            total += sent
            if sent < batch:
                return total


def enqueue_compile(session: Session, bucket: BucketCompile, *, delay_seconds: float = 0.0) -> Outbox:
    """Write the dispatch message for a queued bucket compile into the current transaction, to be sent
    after ``delay_seconds`` (a retry's backoff: the ledger holds it, not the broker, whose delayed messages
    would sit reserved in a worker's prefetch).

    The task id embeds the bucket's fencing token, which every (re)queue bumps, so each dispatch of a
    compile has its own deterministic id and a re-sent row never becomes a second task.
    """
    isa = bucket.material.get("toolchain", {}).get("isa")
    row = Outbox(
        bucket_compile_id=bucket.id,
        task_name=COMPILE_TASK,
        task_id=task_id(bucket.id, bucket.lease_token),
        kwargs={"bucket_compile_id": bucket.id, "queue": bucket.queue, "target": bucket.target,
                "sdk": bucket.sdk, "backend": bucket.backend, "isa": isa},
        available_at=utcnow() + timedelta(seconds=delay_seconds) if delay_seconds > 0 else None,
    )
    session.add(row)
    session.flush()
    return row
