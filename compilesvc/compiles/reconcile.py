"""The reconciler: the ledger is the truth about what must run, the broker only a doorbell. A queued
compile whose message the broker no longer holds is sent again.

A compile is queued in the ledger and announced by one message (:mod:`compilesvc.dispatch.outbox`). That message
can be lost after it was sent: Redis restarted without its data or was flushed, or a worker took it and
acknowledged it without its claim reaching the ledger. Nothing else would ever move such a compile on.

How a lost message is told from a long queue: by **inspecting the broker** (not by age: a queue 500 deep
waiting for one worker is healthy). Each pass lists the compiles that are queued, whose dispatch was sent,
and which were queued at least ``dispatch_grace_seconds`` ago; it then reads which of them the broker
still holds, either waiting in their queue (every priority list of it) or delivered to a worker and not yet
acknowledged (kombu's ``unacked`` hash, where a prefetched or running message lives). A compile that is in
neither place in two passes at least ``dispatch_grace_seconds`` apart (a message moves from the queue to
the unacked hash in two steps, so one look can miss it) is re-sent: its outbox row is marked unsent, and
the relay sends it again under the same task id. A message that turns out to be still alive somewhere is
harmless twice: the claim is a conditional UPDATE, and the second delivery finds nothing to claim.

Brokers: Redis (and Redis Sentinel) are inspected; kombu's filesystem transport (the embedded default) by
its queue folder, where a message a worker has prefetched is invisible, so at most one spare copy of such a
message is sent. Other brokers are not inspected, and their lost messages are not recovered.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import exists, select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.compiles import failures
from compilesvc.compiles.failures import Phase
from compilesvc.dispatch.routing import is_redis_url
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import BucketCompile, Outbox, utcnow
from compilesvc.states import BucketState, ErrorClass

log = logging.getLogger(__name__)

#: Task ids are ``bucket-<bucket compile id>-dispatch-<token>`` (:func:`compilesvc.dispatch.routing.task_id`).
_TASK_ID = re.compile(r"^bucket-(\d+)-dispatch-\d+$")
#: Messages read per Redis round trip while scanning a queue.
_PAGE = 500


class BrokerView(Protocol):
    """What the broker still holds of the compiles' messages."""

    def held_bucket_ids(self, queues: Collection[str]) -> set[int]:
        """Ids of bucket compiles with a message waiting in one of ``queues`` or delivered and unacked.
        Raises when the broker cannot be read (then nothing is concluded)."""
        ...


def bucket_id_of_task(task_id: object) -> int | None:
    match = _TASK_ID.match(task_id) if isinstance(task_id, str) else None
    return int(match.group(1)) if match else None


def _task_id_of(message: Any) -> object:
    """The Celery task id in a kombu message (protocol 2 keeps it in the headers)."""
    if isinstance(message, dict):
        headers = message.get("headers") or {}
        return headers.get("id") or (message.get("properties") or {}).get("correlation_id")
    return None


class RedisView:
    """Reads kombu's Redis keys: ``<prefix><queue>`` (and its priority lists ``<queue>\x06\x16<p>``), the
    ``<prefix>unacked`` hash of delivered messages (values ``[message, exchange, key]``) and the
    ``<prefix>unacked_index`` of their delivery times.

    A delivered message counts as held only for ``claim_window`` seconds: a worker claims what it takes at
    once (retrying the ledger for a bounded time), and with prefetch 1 and late acks it reserves nothing it
    does not start, so a message delivered longer ago whose compile is still queued sits with a worker that
    died or hung before its claim. Redis would hand it back only after the visibility timeout (hours).

    Connects through the producer's own kombu connection (same URL, TLS, Sentinel and timeouts) on first
    use, so a relay starts while Redis is down."""

    def __init__(self, producer: Any, key_prefix: str = "", claim_window: float = 120.0):
        self._producer = producer
        self._prefix = key_prefix
        self._claim_window = claim_window
        self._connection: Any = None
        self._client: Any = None
        self._sep = "\x06\x16"
        self._steps: list[int] = []
        self._unacked = "unacked"
        self._unacked_index = "unacked_index"

    def _connect(self) -> Any:
        if self._client is None:
            import redis  # only when the broker is Redis: a filesystem broker's relay never needs it

            connection = self._producer.connection_for_write()
            channel = connection.default_channel
            # A plain client on kombu's pool: kombu's own prefixes only the commands kombu itself uses.
            self._client = redis.Redis(connection_pool=channel.client.connection_pool)
            self._connection = connection  # the pool lives as long as the kombu connection owning it
            self._sep, self._unacked, self._unacked_index = channel.sep, channel.unacked_key, channel.unacked_index_key
            self._steps = [p for p in channel.priority_steps if p]
        return self._client

    def held_bucket_ids(self, queues: Collection[str]) -> set[int]:
        client = self._connect()
        held: set[int] = set()
        for queue in queues:
            for name in [queue, *(f"{queue}{self._sep}{p}" for p in self._steps)]:
                key = self._prefix + name
                start = 0
                while True:
                    page = client.lrange(key, start, start + _PAGE - 1)
                    for raw in page:
                        self._add(held, raw)
                    if len(page) < _PAGE:
                        break
                    start += _PAGE
        delivered_at = dict(client.zrange(self._prefix + self._unacked_index, 0, -1, withscores=True))
        too_old = time.time() - self._claim_window  # kombu scores deliveries with the worker's time.time()
        for tag, raw in client.hgetall(self._prefix + self._unacked).items():
            if delivered_at.get(tag, too_old + 1) < too_old:
                continue
            try:
                message = json.loads(raw)[0]
            except (ValueError, IndexError, TypeError, KeyError):
                continue
            self._add_message(held, message)
        return held

    def _add(self, held: set[int], raw: bytes | str) -> None:
        with contextlib.suppress(ValueError):
            self._add_message(held, json.loads(raw))

    @staticmethod
    def _add_message(held: set[int], message: Any) -> None:
        bucket_id = bucket_id_of_task(_task_id_of(message))
        if bucket_id is not None:
            held.add(bucket_id)


class FilesystemView:
    """kombu's filesystem transport: one ``<ms>_<uuid>.<queue>.msg`` file per waiting message."""

    def __init__(self, queue_folder: Path):
        self._folder = queue_folder

    def held_bucket_ids(self, queues: Collection[str]) -> set[int]:
        wanted = {f"{q}.msg" for q in queues}
        held: set[int] = set()
        for path in self._folder.iterdir():
            if path.name.partition(".")[2] not in wanted:
                continue
            try:
                message = json.loads(path.read_bytes())
            except (OSError, ValueError):  # taken by a worker while we looked
                continue
            bucket_id = bucket_id_of_task(_task_id_of(message))
            if bucket_id is not None:
                held.add(bucket_id)
        return held


def broker_view(settings: Any, producer: Any) -> BrokerView | None:
    """The view for the configured broker, or None (logged) for one that cannot be inspected."""
    url = settings.resolved_broker_url
    if is_redis_url(url):
        # How long a worker may hold a message before its claim: the claim's own ledger retries, plus a
        # minute for the clocks of the worker (which scores the delivery) and the relay to disagree.
        window = settings.ledger_retry_seconds + settings.dispatch_grace_seconds + 60
        return RedisView(producer, settings.broker_key_prefix, window)
    if url.startswith("filesystem://"):
        return FilesystemView(settings.broker_folder / "queue")
    log.warning("lost broker messages cannot be detected on this broker", extra={"broker": url.split(":", 1)[0]})
    return None


def sent_and_queued(session: Session, older_than: timedelta, limit: int) -> list[tuple[int, str]]:
    """``(id, queue)`` of compiles queued before ``older_than`` whose every dispatch was sent."""
    unsent = select(Outbox.id).where(Outbox.bucket_compile_id == BucketCompile.id, Outbox.sent_at.is_(None))
    rows = session.execute(
        select(BucketCompile.id, BucketCompile.queue)
        .where(BucketCompile.state == BucketState.QUEUED, BucketCompile.queued_at < utcnow() - older_than,
               ~exists(unsent))
        .order_by(BucketCompile.id).limit(limit)
    ).all()
    return [(bucket_id, queue) for bucket_id, queue in rows]


class Reconciler:
    """Re-sends queued compiles whose message the broker lost (see the module docstring). One per relay
    process; several may run at once (a duplicate re-send costs one no-op delivery)."""

    def __init__(self, sessions: sessionmaker[Session], view: BrokerView | None, grace_seconds: float, *,
                 clock: Callable[[], float] = time.monotonic, limit: int = 1000):
        self._sessions = sessions
        self._view = view
        self._grace = grace_seconds
        self._clock = clock
        self._limit = limit
        self._missing_since: dict[int, float] = {}
        #: What the broker held of the candidates in the last pass; None when that pass did not read it (no
        #: view, or the broker failed). The unclaimed-work watch takes it as evidence
        #: (:mod:`compilesvc.compiles.unclaimed`).
        self.held: set[int] | None = None

    def run(self) -> list[int]:
        """One pass; returns the ids of the compiles re-sent (the relay sends them)."""
        self.held = None
        if self._view is None:
            return []
        with self._sessions() as session:
            candidates = sent_and_queued(session, timedelta(seconds=self._grace), self._limit)
        if not candidates:
            self._missing_since.clear()
            self.held = set()
            return []
        held = self._view.held_bucket_ids({queue for _, queue in candidates})
        self.held = held
        now = self._clock()
        missing = {bucket_id: self._missing_since.get(bucket_id, now)
                   for bucket_id, _ in candidates if bucket_id not in held}
        self._missing_since = missing
        lost = [bucket_id for bucket_id, since in missing.items() if now - since >= self._grace]
        resent = [bucket_id for bucket_id in lost if self._resend(bucket_id)]
        for bucket_id in resent:
            del self._missing_since[bucket_id]
        if resent:
            log.warning("re-sent compiles whose broker message was lost", extra={"bucket_compile_ids": resent})
        return resent

    def _resend(self, bucket_id: int) -> bool:
        with transaction(self._sessions) as session:
            bucket = session.scalars(
                select(BucketCompile).where(BucketCompile.id == bucket_id, BucketCompile.state == BucketState.QUEUED)
                .with_for_update(skip_locked=True)
            ).one_or_none()
            latest = session.scalars(select(Outbox).where(Outbox.bucket_compile_id == bucket_id)
                                     .order_by(Outbox.id.desc()).limit(1)).one_or_none()
            if bucket is None or latest is None or latest.sent_at is None:
                return False  # claimed, cancelled or already being re-sent meanwhile
            latest.sent_at = None
            latest.available_at = None
            latest.last_error = "the broker no longer held this message; re-sent by the reconciler"
            failures.record(session, bucket_id, bucket.attempts, Phase.DISPATCH, ErrorClass.INFRA, "DISPATCH_LOST",
                            f"the message of {latest.task_id} was in neither queue {bucket.queue} nor the "
                            f"broker's unacked set for {self._grace:g}s (broker restarted or flushed?); re-sent",
                            retry=True)
            return True
