"""Draining: what a worker told to stop does with the compiles it is running.

An orchestrator scaling in (Kubernetes, Karpenter, an autoscaling group) or reclaiming a spot instance
sends SIGTERM and, a grace period later, SIGKILL. Waiting for a compile of hours would be killed at the
grace period, and the compile would come back only when its lease ran out, counted as a failed attempt.
So a draining worker:

1. takes no new compile (Celery's warm shutdown stops consuming; a task that starts anyway is handed back
   by :func:`workers.tasks.compile_bucket`), and says so in the registry (``draining_at``);
2. lets each running compile go on for the drain window (``COMPILESVC_DRAIN_SECONDS``): one that finishes
   in time is published as usual;
3. stops those still compiling at the window's end and hands each back at once
   (:func:`compilesvc.compiles.leases.interrupt`: requeued through the outbox, the attempt not counted),
   so another worker starts it within seconds, then exits.

A compile that has finished compiling is not interrupted: its output is on this worker, and publishing
takes seconds, not the hours a recompile would.

One :class:`Drain` per process (:data:`DRAIN`); an attempt registers with it while its compile may still be
handed back (:meth:`Drain.register`, :meth:`Drain.release`).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class Interruptible:
    """One attempt as the drain sees it: :attr:`interrupted` and :attr:`event` are set when the window ends while
    it is registered. The drain has an event of its own, never the lease keeper's: that one also stops a
    publish, which a drain must never do (the output is here; publishing takes seconds)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.interrupted = False

    def either(self, stop: threading.Event) -> Either:
        """A stop signal set when ``stop`` is, or when this attempt is interrupted."""
        return Either(stop, self.event)


class Either:
    """Set when any of its events is (what :meth:`CompilerProcess.wait` and the store retries look at)."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self.events[0].wait(min(left, 0.1))
        return True


class Drain:
    """Whether this worker is draining, and the attempts its window's end will interrupt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempts: set[Interruptible] = set()
        self.started = threading.Event()
        self.expired = threading.Event()
        self.why = ""
        self.deadline: float | None = None
        self._timer: threading.Timer | None = None

    @property
    def draining(self) -> bool:
        return self.started.is_set()

    def begin(self, window_seconds: float, why: str) -> bool:
        """Start draining (once; a later call may only shorten the window, e.g. a spot notice after a
        SIGTERM). False if already draining with an earlier or equal deadline."""
        deadline = time.monotonic() + max(window_seconds, 0.0)
        with self._lock:
            if self.deadline is not None and self.deadline <= deadline:
                return False
            first = self.deadline is None
            self.deadline, self.why = deadline, why
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(max(window_seconds, 0.0), self._expire)
            self._timer.daemon = True
            self._timer.start()
            running = len(self._attempts)
        self.started.set()
        log.warning("draining" if first else "drain window shortened",
                    extra={"reason": why, "window_seconds": window_seconds, "running": running})
        return True

    def _expire(self) -> None:
        with self._lock:  # under the lock: an attempt released (compiled) meanwhile is never interrupted
            self.expired.set()
            attempts = list(self._attempts)
            for attempt in attempts:
                self._interrupt(attempt)
        if attempts:
            log.warning("drain window over: handing back the compiles still running",
                        extra={"compiles": len(attempts)})

    @staticmethod
    def _interrupt(attempt: Interruptible) -> None:
        attempt.interrupted = True
        attempt.event.set()

    def register(self) -> Interruptible:
        """An attempt that, from now until :meth:`release`, is interrupted when the drain window ends (at
        once, if it has already ended)."""
        attempt = Interruptible()
        with self._lock:
            self._attempts.add(attempt)
            if self.expired.is_set():
                self._interrupt(attempt)
        return attempt

    def release(self, attempt: Interruptible) -> None:
        """The attempt's compile is over: the window's end no longer concerns it (idempotent)."""
        with self._lock:
            self._attempts.discard(attempt)


#: This process's drain (a worker is one process; its pool threads share it).
DRAIN = Drain()
