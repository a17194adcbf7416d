"""The reconciler against a real Redis broker (a key prefix of its own on the shared server) and kombu's
filesystem broker: a queued compile whose message the broker lost is re-sent, one the broker still holds
(waiting in a long queue, or delivered to a worker and unacked) is left alone."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy import func, select

from compilesvc.compiles import failures
from compilesvc.compiles.reconcile import Reconciler, RedisView, broker_view
from compilesvc.config.settings import Settings
from compilesvc.dispatch.routing import COMPILE_TASK, queue_name
from compilesvc.ledger.models import BucketCompile, Outbox
from compilesvc.services import Services
from tests.compiles.test_leases import make_settings, submit
from tests.workers.conftest import REDIS_URL, delete_redis_keys


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def prefix() -> Iterator[str]:
    value = f"compilesvc-test-{os.getpid()}-{uuid.uuid4().hex[:10]}:"
    yield value
    delete_redis_keys(value)


def redis_services(tmp_path: Path, pg_url: str, prefix: str) -> Services:
    return Services.from_settings(make_settings(tmp_path, pg_url, broker_url=REDIS_URL, broker_key_prefix=prefix,
                                                dispatch_grace_seconds=0.5))


def age_queued(services: Services) -> None:
    """Every queued compile was queued long enough ago to be a candidate."""
    with services.sessions.begin() as session:
        for bucket in session.scalars(select(BucketCompile)):
            bucket.queued_at = bucket.queued_at.replace(year=2000)


def aged_reconciler(services: Services) -> tuple[Reconciler, Clock]:
    """A reconciler (grace 0.5 s, on a clock the test moves) for which every queued compile is old enough."""
    age_queued(services)
    clock = Clock()
    return Reconciler(services.sessions, broker_view(services.settings, services.producer), 0.5, clock=clock), clock


def queue_of(services: Services) -> str:
    return queue_name("inf2", "2.20.0", "trace")  # what tests.compiles.test_leases.submit queues (torchscript)


def redis_length(services: Services, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return int(client.llen(prefix + queue_of(services)))
    finally:
        client.close()


def test_a_flushed_broker_loses_nothing(tmp_path: Path, pg_url: str, prefix: str) -> None:
    services = redis_services(tmp_path, pg_url, prefix)
    try:
        result = submit(services, buckets=3)
        assert redis_length(services, prefix) == 3
        reconciler, clock = aged_reconciler(services)
        assert reconciler.run() == []  # all three are in their queue
        delete_redis_keys(prefix)  # FLUSHALL, as far as this test's broker goes
        assert reconciler.run() == []  # missing once: could be a message between queue and unacked set
        clock.now += 1
        resent = reconciler.run()
        assert sorted(resent) == sorted(b.id for b in bucket_rows(services))
        assert services.relay.relay_all() == 3
        assert redis_length(services, prefix) == 3
        clock.now += 1
        assert reconciler.run() == []  # back in the queue: nothing more to do
        with services.sessions() as session:
            history = failures.of_buckets(session, [b.id for b in bucket_rows(services)])
        assert all([f.code for f in h] == ["DISPATCH_LOST"] for h in history.values())
        assert len(result.buckets) == 3
    finally:
        services.producer.close()
        services.close()


def bucket_rows(services: Services) -> list[BucketCompile]:
    with services.sessions() as session:
        return list(session.scalars(select(BucketCompile).order_by(BucketCompile.id)))


def test_a_message_delivered_to_a_worker_is_held(tmp_path: Path, pg_url: str, prefix: str) -> None:
    services = redis_services(tmp_path, pg_url, prefix)
    try:
        submit(services, buckets=2)
        reconciler, clock = aged_reconciler(services)
        options: dict[str, Any] = {"global_keyprefix": prefix}
        with Connection(REDIS_URL, transport_options=options) as conn:
            queue = conn.SimpleQueue(queue_of(services), no_ack=False)
            message = queue.get(timeout=5)  # delivered, not acknowledged: kombu keeps it in its unacked hash
            assert redis_length(services, prefix) == 1
            for _ in range(3):
                assert reconciler.run() == []
                clock.now += 1
            message.ack()
            queue.close()
        # Acknowledged without a claim (the incident of a worker whose claim raised): lost, so re-sent.
        assert reconciler.run() == []
        clock.now += 1
        assert len(reconciler.run()) == 1
    finally:
        services.producer.close()
        services.close()


def test_a_long_queue_is_not_lost(tmp_path: Path, pg_url: str, prefix: str) -> None:
    settings: Settings = make_settings(tmp_path, pg_url, broker_url=REDIS_URL, broker_key_prefix=prefix)
    services = Services.from_settings(settings)
    try:
        queue = queue_of(services)
        for i in range(1, 1201):  # more than one page of the scan
            services.producer.send_task(COMPILE_TASK, kwargs={"bucket_compile_id": i, "queue": queue, "target": "inf2",
                                                              "sdk": "2.20.0", "backend": "trace"},
                                        task_id=f"bucket-{i}-dispatch-0")
        view = RedisView(services.producer, prefix)
        assert view.held_bucket_ids([queue]) == set(range(1, 1201))
        assert view.held_bucket_ids(["compile.trn2.2.21.0"]) == set()
    finally:
        services.producer.close()
        services.close()


def test_the_filesystem_broker_is_inspected_too(tmp_path: Path, pg_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, pg_url))
    try:
        submit(services, buckets=2)
        reconciler, clock = aged_reconciler(services)
        for _ in range(2):
            assert reconciler.run() == []
            clock.now += 1
        for path in (services.settings.broker_folder / "queue").iterdir():
            path.unlink()
        reconciler.run()
        clock.now += 1
        assert len(reconciler.run()) == 2
        with services.sessions() as session:
            assert session.scalar(select(func.count()).select_from(Outbox).where(Outbox.sent_at.is_(None))) == 2
    finally:
        services.close()


def test_a_message_a_worker_took_long_ago_without_claiming_is_lost(tmp_path: Path, pg_url: str,
                                                                   prefix: str) -> None:
    """A worker died (or hung) between taking a message and claiming its compile: the message sits in the
    unacked set until the visibility timeout (hours), so after the claim window it counts as lost."""
    services = redis_services(tmp_path, pg_url, prefix)
    try:
        submit(services, buckets=1)
        age_queued(services)
        clock = Clock()
        view = RedisView(services.producer, prefix, claim_window=60)
        reconciler = Reconciler(services.sessions, view, 0.5, clock=clock)
        with Connection(REDIS_URL, transport_options={"global_keyprefix": prefix}) as conn:
            queue = conn.SimpleQueue(queue_of(services), no_ack=False)
            queue.get(timeout=5)  # taken, never acknowledged nor claimed
            for _ in range(2):
                assert reconciler.run() == []  # just delivered: a worker may be claiming it right now
                clock.now += 1
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            [(tag, _)] = client.zrange(prefix + "unacked_index", 0, -1, withscores=True)
            client.zadd(prefix + "unacked_index", {tag: time.time() - 3600})  # delivered an hour ago
            client.close()
            assert reconciler.run() == []
            clock.now += 1
            assert len(reconciler.run()) == 1
            queue.close()
    finally:
        services.producer.close()
        services.close()
