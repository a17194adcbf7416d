"""The relay's watch for work nobody takes (compilesvc/compiles/unclaimed.py) against a real Postgres ledger (and
the shared Redis, under a key prefix of the test's own, where the broker matters):
compiles created by the real Submitter and dispatched to kombu's filesystem broker in the test's directory
(whose queue folder the real reconciler reads), workers registered in the ledger, the real reaper pass, and
the relay's metrics endpoint scraped over HTTP."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text, update
from sqlalchemy.dialects import postgresql

from compilesvc.cli.relay_metrics import RelayMetrics, serve
from compilesvc.compiles.reaper import ReapReport, reap
from compilesvc.compiles.reconcile import Reconciler, broker_view
from compilesvc.compiles.unclaimed import (
    StuckQueue,
    UnclaimedReport,
    UnclaimedWatch,
    last_finishes,
    running_of,
    unclaimed_by_queue,
)
from compilesvc.dispatch import registry
from compilesvc.ledger.engine import make_engine, transaction
from compilesvc.ledger.models import BucketCompile, Outbox, Worker, utcnow
from compilesvc.services import Services
from tests.compiles.test_leases import bucket_id, claim, make_settings, submit
from tests.compiles.test_reconcile import queue_of, redis_services
from tests.workers.conftest import delete_redis_keys

BOUND = 2.0  # seconds: the test moves the watch's clock past it instead of waiting


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def services(tmp_path: Path, pg_url: str) -> Iterator[Services]:
    services = Services.from_settings(make_settings(tmp_path, pg_url, dispatch_grace_seconds=0.5))
    yield services
    services.close()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own on the shared Redis."""
    value = f"compilesvc-test-{os.getpid()}-{uuid.uuid4().hex[:10]}:"
    yield value
    delete_redis_keys(value)


class Relay:
    """One relay's reaper state: its reconciler, its watch (on the test's clock) and its metrics."""

    def __init__(self, services: Services, clock: Clock):
        self.services = services
        self.reconciler = Reconciler(services.sessions, broker_view(services.settings, services.producer), 0.5)
        self.watch = UnclaimedWatch(services.sessions, unclaimed_after=BOUND, stale_seconds=90, clock=clock)
        self.metrics = RelayMetrics()

    def reap(self) -> ReapReport:
        report = reap(self.services, reconciler=self.reconciler, watch=self.watch)
        self.metrics.passed(report, 0.01)
        return report

    def gauge(self, name: str, queue: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"queue": queue})


def register(services: Services, worker_id: str, slots: int = 1, queues: list[str] | None = None) -> None:
    with transaction(services.sessions) as session:
        registry.register(session, worker_id, "host", {}, queues or [queue_of(services)], slots)
        session.execute(update(Worker).where(Worker.id == worker_id)
                        .values(started_at=utcnow() - timedelta(seconds=60)))


def dispatched(services: Services, buckets: int, ago: float = 60.0) -> list[int]:
    """``buckets`` compiles queued and sent to the (filesystem) broker ``ago`` seconds ago."""
    result = submit(services, buckets=buckets)
    ids = [bucket_id(services, b.key) for b in result.buckets]
    with transaction(services.sessions) as session:
        then = utcnow() - timedelta(seconds=ago)
        session.execute(update(BucketCompile).where(BucketCompile.id.in_(ids)).values(queued_at=then))
        session.execute(update(Outbox).where(Outbox.bucket_compile_id.in_(ids)).values(sent_at=then))
    return ids


def draining(services: Services, worker_id: str) -> datetime | None:
    with services.sessions() as session:
        return session.get_one(Worker, worker_id).draining_at


def test_unclaimed_work_with_an_idle_worker_is_reported_and_that_worker_told_once(
        services: Services, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="compilesvc.compiles.unclaimed")
    clock = Clock()
    ids = dispatched(services, 2)
    register(services, "w1")
    queue = queue_of(services)
    first, second = Relay(services, clock), Relay(services, clock)

    report = first.reap()  # the first look at an idle worker starts its clock: nothing yet
    second.reap()
    assert report.unclaimed is not None and report.unclaimed.served == {queue} and not report.unclaimed.stuck
    assert first.gauge("compilesvc_relay_unclaimed_compiles", queue) == 0

    clock.advance(BOUND + 1)
    report = first.reap()
    assert report.unclaimed is not None
    stuck = report.unclaimed.stuck[queue]
    assert (stuck.unclaimed, stuck.idle_workers, stuck.held) == (2, ("w1",), 2)  # the broker holds both messages
    assert first.gauge("compilesvc_relay_unclaimed_compiles", queue) == 2
    assert first.gauge("compilesvc_relay_unclaimed_oldest_age_seconds", queue) >= 60
    assert report.unclaimed.told == ["w1"] and draining(services, "w1") is not None
    assert first.metrics.registry.get_sample_value("compilesvc_relay_workers_told_to_stop_total") == 1
    lines = {r.getMessage(): r.__dict__ for r in caplog.records if r.name == "compilesvc.compiles.unclaimed"}
    noticed = lines["compiles dispatched and not claimed"]
    assert (noticed["queue"], noticed["unclaimed"], noticed["idle_workers"]) == (queue, 2, ["w1"])
    assert noticed["oldest_age_seconds"] >= 60
    told = lines["told a worker to stop: it takes no work"]
    assert told["worker"] == "w1" and told["queue"] == queue and "sat unclaimed" in told["reason"]

    # A second relay in the same pass tells nobody (the worker is draining already), and counts nothing.
    told_at = draining(services, "w1")
    report = second.reap()
    assert report.unclaimed is not None and report.unclaimed.told == [] and draining(services, "w1") == told_at
    assert second.metrics.registry.get_sample_value("compilesvc_relay_workers_told_to_stop_total") == 0
    assert report.unclaimed.served == set()  # a draining worker serves nothing: its queue leaves the gauges
    first.reap()
    gone = [r for r in caplog.records if r.getMessage() == "unclaimed compiles no longer reported"]
    assert [(r.__dict__["queue"], r.__dict__["served"]) for r in gone] == [(queue, False)]
    assert second.gauge("compilesvc_relay_unclaimed_compiles", queue) is None

    # Its successor claims them: the queue is served again and nothing is unclaimed.
    register(services, "w2", slots=2)
    assert all(claim(services, i, "w2") for i in ids)
    clock.advance(BOUND + 1)
    first.reap()
    assert first.gauge("compilesvc_relay_unclaimed_compiles", queue) == 0
    assert first.gauge("compilesvc_relay_unclaimed_oldest_age_seconds", queue) == 0


def test_the_gauge_falls_once_the_compiles_are_claimed(services: Services) -> None:
    clock = Clock()
    ids = dispatched(services, 3)
    register(services, "w1", slots=1)
    relay = Relay(services, clock)
    relay.reconciler = Reconciler(services.sessions, None, 0.5)  # a broker it cannot read: report, never tell
    queue = queue_of(services)
    relay.reap()
    clock.advance(BOUND + 1)
    report = relay.reap()
    assert report.unclaimed is not None and report.unclaimed.stuck[queue].unclaimed == 3
    assert report.unclaimed.told == [] and draining(services, "w1") is None
    assert relay.gauge("compilesvc_relay_unclaimed_compiles", queue) == 3

    register(services, "w2", slots=4)
    assert claim(services, ids[0], "w2") and claim(services, ids[1], "w2")
    clock.advance(1)
    relay.reap()
    assert relay.gauge("compilesvc_relay_unclaimed_compiles", queue) == 1
    assert claim(services, ids[2], "w2")
    relay.reap()
    assert relay.gauge("compilesvc_relay_unclaimed_compiles", queue) == 0


def test_no_alive_worker_a_stale_one_or_a_busy_pool_is_not_stuck(services: Services) -> None:
    clock = Clock()
    ids = dispatched(services, 2)
    relay = Relay(services, clock)
    queue = queue_of(services)
    for _ in range(2):  # no worker at all: admission's and the scaler's case
        report = relay.reap()
        clock.advance(BOUND + 1)
        assert report.unclaimed is not None and not report.unclaimed.stuck and not report.unclaimed.served

    register(services, "silent")
    with transaction(services.sessions) as session:  # registered, but its heartbeat is old
        session.execute(update(Worker).where(Worker.id == "silent")
                        .values(heartbeat_at=utcnow() - timedelta(seconds=600)))
    register(services, "busy", slots=1)
    assert claim(services, ids[0], "busy")  # its one slot is taken: it could not take the other compile
    for _ in range(3):
        report = relay.reap()
        clock.advance(BOUND + 1)
        assert report.unclaimed is not None and report.unclaimed.served == {queue}
        assert not report.unclaimed.stuck and not report.unclaimed.told
    assert relay.gauge("compilesvc_relay_unclaimed_compiles", queue) == 0
    assert draining(services, "busy") is None and draining(services, "silent") is None


def test_a_worker_that_just_freed_a_slot_or_a_fresh_resend_is_not_stuck(services: Services) -> None:
    clock = Clock()
    ids = dispatched(services, 2)
    register(services, "w1", slots=1)
    relay = Relay(services, clock)
    queue = queue_of(services)
    c = claim(services, ids[0], "w1")
    assert c is not None
    relay.reap()
    clock.advance(BOUND + 1)
    relay.reap()  # busy all along
    with transaction(services.sessions) as session:  # it finishes (the compile failed): a free slot from now
        session.execute(update(BucketCompile).where(BucketCompile.id == ids[0])
                        .values(state="failed", finished_at=clock.now, lease_expires_at=None))
    report = relay.reap()
    assert report.unclaimed is not None and not report.unclaimed.stuck  # idle for no time yet

    # The reconciler re-sent the other one just now (the broker had lost it): its clock restarts too.
    with transaction(services.sessions) as session:
        session.execute(update(Outbox).where(Outbox.bucket_compile_id == ids[1]).values(sent_at=clock.now))
    clock.advance(BOUND - 0.5)
    report = relay.reap()
    assert report.unclaimed is not None and not report.unclaimed.stuck
    clock.advance(1)
    report = relay.reap()  # both bounds passed: a re-send left unclaimed too
    assert report.unclaimed is not None and report.unclaimed.stuck[queue].unclaimed == 1
    assert report.unclaimed.told == ["w1"]


def test_on_redis_a_lost_message_is_re_sent_before_any_worker_is_told(tmp_path: Path, pg_url: str,
                                                                      redis_prefix: str) -> None:
    """A pool of two idle workers, and Redis restarted without the queue (as in issue 37): the relay re-sends
    rather than stopping the pool; only once the re-sent messages wait in Redis for the whole bound, unclaimed,
    is each idle worker told (the wedged-consumer case)."""
    services = redis_services(tmp_path, pg_url, redis_prefix)
    try:
        clock = Clock()
        ids = dispatched(services, 2)
        register(services, "w1")
        register(services, "w2")
        delete_redis_keys(redis_prefix)  # the broker lost every message
        relay = Relay(services, clock)
        relay.reap()  # the reconciler's first look, the watch's first sight of the idle pool
        clock.advance(BOUND + 1)
        time.sleep(0.6)  # the reconciler's second look, its grace (0.5 s) later
        report = relay.reap()
        assert sorted(report.resent) == sorted(ids) and report.relayed == 2
        assert report.unclaimed is not None and not report.unclaimed.stuck and report.unclaimed.told == []
        assert draining(services, "w1") is None and draining(services, "w2") is None
        clock.advance(BOUND + 1)  # the re-sent messages wait in Redis, and nobody takes them
        report = relay.reap()
        assert report.unclaimed is not None and report.unclaimed.stuck[queue_of(services)].held == 2
        assert report.unclaimed.told == ["w1", "w2"]
    finally:
        services.producer.close()
        services.close()


def test_a_worker_that_claimed_since_it_was_seen_idle_is_not_told(services: Services) -> None:
    clock = Clock()
    ids = dispatched(services, 2)
    register(services, "w1", slots=2)
    relay = Relay(services, clock)
    relay.reap()
    clock.advance(BOUND + 1)
    relay.reconciler.run()
    # Between the watch's read and its UPDATE the worker claims: the UPDATE's own condition refuses.
    watch_read = relay.watch._alive

    def alive_then_claim(session, now):  # type: ignore[no-untyped-def]
        found = watch_read(session, now)
        assert claim(services, ids[0], "w1")
        return found
    relay.watch._alive = alive_then_claim  # type: ignore[method-assign]
    report = relay.watch.run(relay.reconciler.held)
    assert queue_of(services) in report.stuck and report.told == [] and draining(services, "w1") is None


def test_the_query_reads_queued_rows_by_index_at_a_realistic_history(services: Services, pg_url: str) -> None:
    """30k finished compiles with a dispatch each, 500 queued (the partial index holds the active rows only, so
    a longer history of finished compiles does not reach them): the planner's choice, after ANALYZE."""
    queue = queue_of(services)
    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO bucket_compiles (key, state, target, sdk, backend, queue, model, material, inputs, attempts, "
            "max_attempts, attempt_round, interruptions, lease_token, cancel_requested, queued_at, updated_at, "
            "finished_at) SELECT 'k' || g, CASE WHEN g % 60 = 0 THEN 'queued' ELSE 'succeeded' END, 'inf2', "
            "'2.20.0', 'trace', :queue, '{}', '{}', '[]', 1, 3, 0, 0, 1, false, now(), now(), "
            "now() - g * interval '1 second' FROM generate_series(1, 30000) g"), {"queue": queue})
        conn.execute(text(
            "INSERT INTO outbox (bucket_compile_id, task_name, task_id, kwargs, created_at, sent_at, send_attempts) "
            "SELECT id, 't', 'bucket-' || id || '-dispatch-1', '{}', now(), now() - interval '1 hour', 1 "
            "FROM bucket_compiles"))
        conn.execute(text("ANALYZE bucket_compiles"))
        conn.execute(text("ANALYZE outbox"))
        query = unclaimed_by_queue([queue], utcnow() - timedelta(seconds=300), {60, 120})
        sql = str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        plan = "\n".join(conn.scalars(text("EXPLAIN " + sql)))
        assert "ix_bucket_compiles_active_queue" in plan, plan
        assert "Seq Scan" not in plan, plan
        oldest = conn.execute(text("SELECT min(sent_at) FROM outbox")).scalar()
        assert conn.execute(text(sql)).one()[1:] == (500, oldest, 2)
        # The watch's other reads: running compiles and recent finishes, of a few workers.
        for other in (running_of(["w1", "w2"]), last_finishes(["w1", "w2"], utcnow() - timedelta(seconds=300))):
            sql = str(other.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
            plan = "\n".join(conn.scalars(text("EXPLAIN " + sql)))
            assert "Index" in plan and "Seq Scan" not in plan, plan
    engine.dispose()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_the_endpoint_serves_what_the_pass_set(services: Services, tmp_path: Path) -> None:
    clock = Clock()
    dispatched(services, 2)
    register(services, "w1")
    relay = Relay(services, clock)
    server = serve(relay.metrics, "127.0.0.1", 0)
    try:
        relay.reap()
        clock.advance(BOUND + 1)
        relay.reap()
        body = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    assert samples[("compilesvc_relay_unclaimed_compiles", (("queue", queue_of(services)),))] == 2
    assert samples[("compilesvc_relay_workers_told_to_stop_total", ())] == 1
    assert samples[("compilesvc_relay_reaper_pass_seconds_count", ())] == 2
    assert samples[("compilesvc_relay_reaper_last_success_timestamp_seconds", ())] > 0


#: promtool on PATH, or where .ci/test-tools unpacks it (Debian's prometheus package, not installed: that would
#: start a server).
PROMTOOL = shutil.which("promtool") or next(
    (str(p) for p in [Path(__file__).resolve().parents[2] / ".ci" / "promtool" / "usr" / "bin" / "promtool"]
     if p.is_file()), None)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (`make test-tools` unpacks it into "
                                             ".ci/promtool from Debian's prometheus package)")
def test_promtool_accepts_the_endpoint_s_output(tmp_path: Path) -> None:
    metrics = RelayMetrics()
    now = utcnow()
    stuck = StuckQueue("compile.cpu.2.13.0", 3, now - timedelta(seconds=400), ("w1",), 3)
    metrics.passed(ReapReport(unclaimed=UnclaimedReport({"compile.cpu.2.13.0", "compile.inf2.2.20.0.trace"},
                                                        {stuck.name: stuck}, ["w1"], now)), 0.02)
    server = serve(metrics, "127.0.0.1", 0)
    try:
        body = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    path = tmp_path / "metrics.txt"
    path.write_text(body)
    with path.open() as stdin:
        check = subprocess.run([str(PROMTOOL), "check", "metrics"], stdin=stdin,
                               capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def relay_env(services: Services, **extra: str) -> dict[str, str]:
    settings = services.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env.update({"COMPILESVC_DATA_DIR": str(settings.data_dir), "COMPILESVC_DATABASE_URL": settings.database_url or "",
                "COMPILESVC_STORE_URL": settings.resolved_store_url, "COMPILESVC_BROKER_URL": "filesystem://",
                "COMPILESVC_SECRET_KEY": "k", "COMPILESVC_RELAY_METRICS_BIND": "127.0.0.1", **extra})
    return env


@pytest.mark.slow
def test_the_relay_process_serves_its_metrics(services: Services) -> None:
    """`compilesvc relay` with COMPILESVC_RELAY_METRICS_PORT=0: it logs the port it bound, and a scrape shows a
    reaper pass that succeeded; SIGTERM stops it with 0."""
    command = [str(Path(sys.executable).with_name("compilesvc")), "relay", "--reap-interval", "0.2"]
    proc = subprocess.Popen(command, env=relay_env(services, COMPILESVC_RELAY_METRICS_PORT="0"),
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        started: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if line.startswith("{") and json.loads(line)["msg"] == "relay started":
                started = json.loads(line)
        assert isinstance(started.get("metrics_port"), int), started
        value = None
        while value is None and time.monotonic() < deadline:
            families = text_string_to_metric_families(scrape(int(started["metrics_port"])))  # type: ignore[call-overload]
            value = next((s.value for f in families for s in f.samples
                          if s.name == "compilesvc_relay_reaper_last_success_timestamp_seconds" and s.value > 0), None)
            time.sleep(0.2)
        assert value is not None and abs(value - time.time()) < 60
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_a_port_it_cannot_bind_stops_the_relay_with_one_line(services: Services) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([str(Path(sys.executable).with_name("compilesvc")), "relay"],
                              env=relay_env(services, COMPILESVC_RELAY_METRICS_PORT=str(port)),
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}: ") and "Traceback" not in proc.stderr
