"""Prometheus metrics of the API process, plus ledger-derived metrics computed at scrape time.

Two kinds, because compiles happen in other processes (workers on other hosts):

- counters this process increments (submits, and their outcomes: hit / join / new) by target and SDK;
- :class:`LedgerCollector`, which reads the ledger when scraped: finished compiles by target, SDK and
  outcome, a compile-seconds histogram, queue depth and running compiles per queue, live workers.
  Its result is cached for a few seconds so that several scrapers (or a scrape storm) cost one round of
  queries, and a ledger outage turns into ``compilesvc_ledger_up 0`` rather than a failed scrape.

Under gunicorn with several workers, counters live in ``PROMETHEUS_MULTIPROC_DIR`` (set by
``compilesvc serve``) and are summed over the worker processes at scrape time, whichever worker answers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.dispatch.registry import live_workers
from compilesvc.ledger.models import BucketCompile
from compilesvc.states import BucketState

log = logging.getLogger(__name__)

#: Compile-time buckets (seconds): neuron compiles take minutes to hours.
COMPILE_SECONDS_BUCKETS: tuple[float, ...] = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
FINISHED_STATES = (BucketState.SUCCEEDED, BucketState.FAILED, BucketState.CANCELLED)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ApiMetrics:
    """The API's own counters, in ``registry`` (or in the multiprocess directory when one is set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # In multiprocess mode the values go to mmap files that MultiProcessCollector reads; registering
        # them in the registry as well would export each twice.
        target = None if multiprocess_dir() else registry
        self.submits = Counter("compilesvc_submits", "Valid compile specs submitted to the API.",
                               ["target", "sdk"], registry=target)
        self.outcomes = Counter("compilesvc_submit_outcomes",
                                "Accepted submits by outcome: hit (published), join (in flight), new (queued).",
                                ["target", "sdk", "outcome"], registry=target)


def make_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    if multiprocess_dir():
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


class LedgerCollector(Collector):
    """Metrics read from the ledger at scrape time (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], stale_seconds: int, cache_seconds: float = 5.0):
        self._sessions = sessions
        self._stale_seconds = stale_seconds
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Metric]] | None = None

    def describe(self) -> Iterator[Metric]:
        # Declaring nothing keeps registration from running a scrape (auto_describe would call collect).
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > self._cache_seconds:
                self._cached = (now, self._read())
            metrics = self._cached[1]
        yield from metrics

    def _read(self) -> list[Metric]:
        up = GaugeMetricFamily("compilesvc_ledger_up", "1 when the ledger answered the metrics queries.")
        try:
            with self._sessions() as session:
                if session.get_bind().dialect.name == "postgresql":
                    session.execute(text("SET LOCAL statement_timeout = 5000"))
                metrics = self._query(session)
        except Exception as exc:  # a scrape must not fail because the ledger is down
            log.warning("ledger metrics unavailable", extra={"error": f"{type(exc).__name__}: {exc}"})
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *metrics]

    def _query(self, session: Session) -> list[Metric]:
        bc = BucketCompile
        finished = GaugeMetricFamily(
            "compilesvc_compiles",
            "Bucket compiles in the ledger that finished, by target, SDK and outcome (a retried compile "
            "moves from failed to its new outcome, hence a gauge).",
            labels=["target", "sdk", "outcome"])
        for target, sdk, state, count in session.execute(
            select(bc.target, bc.sdk, bc.state, func.count()).where(bc.state.in_(FINISHED_STATES))
            .group_by(bc.target, bc.sdk, bc.state)
        ):
            finished.add_metric([target, sdk, state], count)

        histogram = HistogramMetricFamily(
            "compilesvc_compile_seconds", "Compile time of succeeded bucket compiles, by target and SDK.",
            labels=["target", "sdk"])
        le_columns = [func.sum(case((bc.compile_seconds <= bound, 1), else_=0)) for bound in COMPILE_SECONDS_BUCKETS]
        for target, sdk, count, total, *cumulative in session.execute(
            select(bc.target, bc.sdk, func.count(), func.coalesce(func.sum(bc.compile_seconds), 0.0), *le_columns)
            .where(bc.state == BucketState.SUCCEEDED, bc.compile_seconds.is_not(None))
            .group_by(bc.target, bc.sdk)
        ):
            pairs = zip(COMPILE_SECONDS_BUCKETS, cumulative, strict=True)
            buckets = [(_le(bound), float(n or 0)) for bound, n in pairs]
            buckets.append(("+Inf", float(count)))
            histogram.add_metric([target, sdk], buckets, float(total))

        depth = GaugeMetricFamily("compilesvc_queue_depth", "Bucket compiles waiting in each queue.",
                                  labels=["queue"])
        running = GaugeMetricFamily("compilesvc_compiles_running", "Bucket compiles running, per queue.",
                                    labels=["queue"])
        for queue, state, count in session.execute(
            select(bc.queue, bc.state, func.count()).where(bc.state.in_((BucketState.QUEUED, BucketState.RUNNING)))
            .group_by(bc.queue, bc.state)
        ):
            (depth if state == BucketState.QUEUED else running).add_metric([queue], count)

        workers = GaugeMetricFamily("compilesvc_workers_live", "Workers that heartbeated recently.")
        workers.add_metric([], len(live_workers(session, self._stale_seconds)))
        return [finished, histogram, depth, running, workers]


def _le(bound: float) -> str:
    return str(float(bound))
