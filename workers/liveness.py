"""A worker is alive when it consumes: the canary check, and what a worker that stopped consuming does.

Why a check of its own: Celery's consumer can stop taking messages after its Redis connection breaks while
the process, its pool and every other thread stay healthy. The connection loss makes the acks of the
compiles that just finished fail (``Couldn't ack ..., reason:network:ConnectionError``), and the consumer
never issues another ``BRPOP`` (celery/celery#10302, a reopening of #10205 "worker stops consuming Redis
tasks after broker connection reset ... does not recover automatically", still seen on 5.6.3; the same class
as #9054 "Celery worker stops consuming after Redis restart", whose fix was kombu PR #2007 in 5.4.0, and
#8030 "worker stops consuming tasks after redis reconnection on 5.2.3"). The registry heartbeat, a thread of
its own, goes on, so the worker looks alive while the compiles routed to it wait forever. Nothing upstream
promises this class is gone, so the worker proves consuming end to end, through the broker:

- every ``liveness_check_seconds``, if it has a free slot (fewer reserved requests than its concurrency:
  ``celery.worker.state.reserved_requests``, which Celery fills when the consumer takes a message and empties
  when the task is done, celery/worker/state.py ``task_reserved``/``task_ready``), it sends a canary task to
  ``compile.canary.<worker id>``, a queue only it consumes, and waits ``liveness_bound_seconds`` for the
  consumer to receive a message: the canary, or any compile (Celery's ``task_received`` signal, sent by the
  consumer for every message it turns into a request, celery/worker/strategy.py). With no free slot the
  check is skipped: with prefetch 1 a busy worker cannot take a canary, and its running compiles prove
  nothing about consuming. A canary that cannot even be sent (the broker is down) is no verdict: a restart
  would not help, and the next check after the broker is back decides;
- when the canary does not arrive, or the registry heartbeat finds the worker's ``draining_at`` set by
  another process (the relay, finding work nobody takes), the worker **stops** (:meth:`Liveness.stop`): it
  marks itself draining in the registry (admission and the queue depths then count it as no consumer), takes
  nothing new (:func:`workers.tasks.compile_bucket` hands any message back), lets running compiles finish and
  publish (each is bounded by the compile timeout; publishing needs only the ledger and the store), and then
  exits with :data:`EXIT_NOT_CONSUMING` so its supervisor (compose ``restart:``, Kubernetes, systemd) starts a
  fresh one. Celery's warm shutdown ends the process; should the wedged consumer keep it from returning, the
  process exits by itself ``EXIT_GRACE_SECONDS`` later.

What the check found goes to the liveness file (:mod:`compilesvc.liveness`), which ``compilesvc worker
--check-alive`` reads for compose's healthcheck and the chart's livenessProbe: a stopping worker stays
alive to the probe while its compiles finish (its own deadline is the task's hard limit), so the
orchestrator does not kill them.

SIGTERM is unchanged: a drain (:mod:`workers.compiling.drain`), exit 0.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compilesvc.config.settings import Settings
from compilesvc.liveness import LivenessFile, default_path

log = logging.getLogger("compilesvc.worker.liveness")

CANARY_TASK = "compilesvc.canary"
#: EX_TEMPFAIL (sysexits.h): the worker stopped consuming, or was told to stop; a fresh process will do.
EXIT_NOT_CONSUMING = 75
#: After Celery was told to shut down (SIGTERM to itself): how long it may take before the process exits anyway.
EXIT_GRACE_SECONDS = 30.0


def canary_queue(worker_id: str) -> str:
    """The queue only this worker consumes: under ``compile.*``, so the broker users' key rules cover it
    (docker/redis/users.sh); never registered, so the registry, admission and the reconciler never see it.
    Characters other than ``A-Za-z0-9._-`` become ``-``: kombu's filesystem transport (the embedded broker)
    refuses any other in a queue's exchange name (kombu/transport/filesystem.py, ``EXCHANGE_NAME_RE``, 5.7.0)."""
    return "compile.canary." + re.sub(r"[^A-Za-z0-9._-]", "-", worker_id)


def liveness_path(settings: Settings) -> Path:
    return settings.liveness_file or default_path("worker")


def reserved() -> int:
    """Messages this worker's consumer holds (waiting for a slot or running)."""
    from celery.worker import state

    return len(state.reserved_requests)


class Liveness:
    """This worker's consuming check and its stop (one per process: :data:`LIVENESS`)."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.why = ""
        self._received = 0.0  # monotonic time the consumer last received a message
        self._lock = threading.Lock()

    def received(self, **_: Any) -> None:
        """Celery's ``task_received``: the consumer took a message."""
        self._received = time.monotonic()

    def stop(self, why: str, on_stop: Callable[[], None] | None = None) -> bool:
        """Stop advertising, take nothing new, exit once running compiles end (once; False if already)."""
        with self._lock:
            if self.stopping.is_set():
                return False
            self.why = why
            self.stopping.set()
        log.error("not consuming: stopping, to be restarted",
                  extra={"reason": why, "running": reserved(), "exit_code": EXIT_NOT_CONSUMING})
        if on_stop is not None:
            on_stop()
        return True


#: This process's liveness (its pool threads and the heartbeat share it).
LIVENESS = Liveness()


class CanaryMonitor:
    """The thread that checks consuming, writes the liveness file and ends a stopping worker."""

    def __init__(self, settings: Settings, worker_id: str, concurrency: int, send: Callable[[str], None],
                 on_stop: Callable[[], None], liveness: Liveness = LIVENESS):
        self.settings = settings
        self.queue = canary_queue(worker_id)
        self.concurrency = concurrency
        self.send = send
        self.on_stop = on_stop
        self.liveness = liveness
        self.file = LivenessFile(liveness_path(settings))
        self.interval = settings.liveness_check_seconds
        self.bound = settings.liveness_bound_seconds
        # Until the next write: a check's interval and bound, and slack for a loaded host.
        self.fresh_for = self.interval + self.bound + max(10.0, self.interval)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def starting(self) -> None:
        """Before Celery consumes: a probe reads the file a restarted container left with its old pid."""
        self.file.write("starting", self.fresh_for + 60, "connecting to the broker")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                if self.liveness.stopping.is_set():
                    self._wind_down()
                    return
                self._check()
            except Exception:  # the check must outlive its own bugs; a stale file then says so
                log.exception("liveness check failed")
            # Woken at once by a stop (the heartbeat thread reads a draining_at the relay set between checks):
            # waiting out the interval would keep a told worker idle and advertised as stopping for that long.
            self.liveness.stopping.wait(self.interval)

    def _check(self) -> None:
        held = reserved()
        if held >= self.concurrency:
            self.file.write("busy", self.fresh_for, f"{held} of {self.concurrency} slots busy: check skipped")
            return
        sent_at = time.monotonic()
        try:
            self.send(self.queue)
        except Exception as exc:  # the broker is away: a fresh process could not consume either
            log.warning("could not send the liveness canary", extra={"error": f"{type(exc).__name__}: {exc}"})
            self.file.write("alive", self.fresh_for, "broker unreachable: no verdict")
            return
        deadline = sent_at + self.bound
        while time.monotonic() < deadline:
            if self.liveness._received >= sent_at or self.liveness.stopping.is_set():
                break
            self.stop_event.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
        if self.liveness._received >= sent_at:
            self.file.write("alive", self.fresh_for)
        elif not self.liveness.stopping.is_set():
            self.liveness.stop(f"no message received within {self.bound:g} s of a canary sent to {self.queue}",
                               self.on_stop)

    def _wind_down(self) -> None:
        """Wait for the running compiles (bounded by the task's hard limit), then end the process."""
        give_up = time.monotonic() + self.settings.task_hard_limit_seconds
        while reserved() and time.monotonic() < give_up:
            self.file.write("stopping", self.fresh_for,
                            f"{self.liveness.why}; {reserved()} compile(s) finishing")
            self.stop_event.wait(min(self.interval, 1.0))
        self.file.write("dead", 0, f"exited {EXIT_NOT_CONSUMING}: {self.liveness.why}")
        log.error("not consuming: running compiles done, exiting", extra={"exit_code": EXIT_NOT_CONSUMING})
        # Celery's warm shutdown: the same path as a SIGTERM (the worker's main returns, the registry row is
        # marked stopped); with nothing running, its drain has nothing to do.
        os.kill(os.getpid(), signal.SIGTERM)
        if not self.stop_event.wait(EXIT_GRACE_SECONDS):
            log.error("Celery did not shut down: exiting anyway", extra={"exit_code": EXIT_NOT_CONSUMING})
            logging.shutdown()
            os._exit(EXIT_NOT_CONSUMING)


def install(settings: Settings, worker_id: str, concurrency: int, on_stop: Callable[[], None]) -> CanaryMonitor:
    """Count received messages, and start the canary check once Celery consumes (``worker_ready``)."""
    from celery.signals import task_received, worker_ready

    from workers.celery_app import worker_app

    app = worker_app()
    expires = max(settings.liveness_bound_seconds * 2, 10.0)

    def send(queue: str) -> None:
        # No retries: a broker that is away is no verdict (see CanaryMonitor._check). The expiry keeps a canary
        # the consumer takes late (it was wedged, or busy since) from running as news.
        app.send_task(CANARY_TASK, queue=queue, expires=expires, retry=False,
                      ignore_result=True)

    monitor = CanaryMonitor(settings, worker_id, concurrency, send, on_stop)
    task_received.connect(LIVENESS.received, weak=False)
    monitor.starting()

    @worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
    def _start(**_: Any) -> None:
        monitor.start()

    return monitor
