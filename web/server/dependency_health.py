"""The broker's and the store's health as metrics, not as readiness.

A lookup needs neither (the broker is a doorbell: the outbox keeps what it could not ring; the manifest cache
answers what the store holds), so a Redis or S3 blip must not take every API pod out of its Service at once
(``/readyz`` checks the ledger alone). What an operator still needs — is the broker reachable from this API
process, is the store — is exported here as ``compilesvc_dependency_up{dependency}`` and the check's duration,
for alerts to act on.

Each check runs in its own thread, at most one in flight per dependency, all at once, and a scrape waits at most
``timeout`` for them together: a store whose HEAD hangs for its client's connect timeout reads as down within
the scrape's budget instead of stalling the scrape. Results are cached for ``cache_seconds`` so several scrapers
cost one round of checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from compilesvc.services import Services

log = logging.getLogger(__name__)

BROKER_TIMEOUT_SECONDS = 2.0
#: How long a scrape waits for one check: under Prometheus's default scrape timeout (10 s).
CHECK_TIMEOUT_SECONDS = 3.0

Check = Callable[[], None]


def broker_check(services: Services) -> Check:
    def check() -> None:
        with services.producer.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, interval_max=0,
                                   timeout=BROKER_TIMEOUT_SECONDS)
    return check


def store_check(services: Services) -> Check:
    return services.store.check


@dataclass
class _Result:
    up: bool
    seconds: float
    error: str = ""


class _Probe:
    """One dependency's check: one thread at a time, its last result kept."""

    def __init__(self, name: str, check: Check, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self._check = check
        self._thread: threading.Thread | None = None
        self._result: _Result | None = None
        self._lock = threading.Lock()

    def start(self) -> threading.Thread:
        """The check's thread: a new one unless the last is still running."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._result = None
                self._thread = threading.Thread(target=self._run, name=f"dependency-check-{self.name}", daemon=True)
                self._thread.start()
            return self._thread

    def wait(self, thread: threading.Thread, deadline: float) -> _Result:
        timeout = max(0.0, deadline - time.monotonic())
        thread.join(timeout)
        with self._lock:
            if self._result is not None and not thread.is_alive():
                return self._result
        # Still running: a check that outlives the scrape's budget is a dependency that is not answering.
        return _Result(up=False, seconds=self.timeout, error=f"no answer within {self.timeout:g} s")

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._check()
        except Exception as exc:  # every failure of a dependency is "down", never a failed scrape
            result = _Result(up=False, seconds=time.perf_counter() - started,
                             error=f"{type(exc).__name__}: {exc}"[:500])
        else:
            result = _Result(up=True, seconds=time.perf_counter() - started)
        with self._lock:
            self._result = result


class DependencyCollector(Collector):
    """``compilesvc_dependency_up`` and ``compilesvc_dependency_check_seconds`` for each named check."""

    def __init__(self, checks: Mapping[str, Check], cache_seconds: float = 5.0,
                 timeout: float = CHECK_TIMEOUT_SECONDS) -> None:
        self._probes = [_Probe(name, check, timeout) for name, check in checks.items()]
        self._cache_seconds = cache_seconds
        self._timeout = timeout
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, _Result]] | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registration must not run the checks

    def results(self) -> dict[str, _Result]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > self._cache_seconds:
                # Every check at once, all bounded by one deadline: a scrape waits at most one timeout.
                threads = [(probe, probe.start()) for probe in self._probes]
                deadline = time.monotonic() + self._timeout
                results = {probe.name: probe.wait(thread, deadline) for probe, thread in threads}
                for name, result in results.items():
                    if not result.up:
                        log.warning("dependency check failed", extra={"dependency": name, "error": result.error})
                self._cached = (time.monotonic(), results)
            return self._cached[1]

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("compilesvc_dependency_up",
                               "1 when this API process reached the dependency at its last check (broker, store).",
                               labels=["dependency"])
        seconds = GaugeMetricFamily("compilesvc_dependency_check_seconds",
                                    "How long the dependency's last check took (its timeout when it did not answer).",
                                    labels=["dependency"])
        for name, result in self.results().items():
            up.add_metric([name], 1.0 if result.up else 0.0)
            seconds.add_metric([name], result.seconds)
        yield up
        yield seconds


__all__ = ["DependencyCollector", "broker_check", "store_check"]
