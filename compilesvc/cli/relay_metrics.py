"""The relay's Prometheus metrics and their endpoint (``COMPILESVC_RELAY_METRICS_PORT``).

Every value is set by the reaper pass (:func:`compilesvc.compiles.reaper.reap`), never computed when scraped: a
scrape reads memory only, whatever the size of the ledger. Each relay process has its own registry (tests run
several loops in one process) and its own endpoint; Prometheus scrapes every relay. Label sets are bounded: a
queue name (bounded by the pools and releases deployed), never a worker, build or compile id.

Gauges per queue cover the queues served by an alive worker; a queue no worker serves any longer is dropped
(it is admission's and the scaler's case, not a worker that stopped consuming).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from compilesvc.compiles.reaper import ReapReport

#: A pass is milliseconds on a quiet ledger; seconds mean a slow store (a late publish) or a broker timeout.
PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RelayMetrics:
    """The relay's metrics on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.unclaimed = Gauge(
            "compilesvc_relay_unclaimed_compiles",
            "Compiles dispatched at least COMPILESVC_UNCLAIMED_AFTER_SECONDS ago and still unclaimed, on a queue "
            "a worker with a free slot has served without claiming for as long (compilesvc/compiles/unclaimed.py).",
            ["queue"], registry=self.registry)
        self.unclaimed_oldest = Gauge(
            "compilesvc_relay_unclaimed_oldest_age_seconds",
            "Seconds since the oldest of those compiles was dispatched (0: none).",
            ["queue"], registry=self.registry)
        self.told_to_stop = Counter(
            "compilesvc_relay_workers_told_to_stop",
            "Workers this relay told to stop (workers.draining_at) because work sat unclaimed on their queue.",
            registry=self.registry)
        self.pass_seconds = Histogram(
            "compilesvc_relay_reaper_pass_seconds", "How long each reaper pass took, failed ones included.",
            buckets=PASS_BUCKETS, registry=self.registry)
        self.pass_failures = Counter(
            "compilesvc_relay_reaper_pass_failures", "Reaper passes that raised (the ledger or broker down).",
            registry=self.registry)
        self.last_success = Gauge(
            "compilesvc_relay_reaper_last_success_timestamp_seconds",
            "Unix time the last reaper pass finished without raising.", registry=self.registry)
        self._queues: set[str] = set()

    def passed(self, report: ReapReport, seconds: float) -> None:
        self.pass_seconds.observe(seconds)
        self.last_success.set(time.time())
        unclaimed = report.unclaimed
        if unclaimed is None:  # the watch's own step failed: keep what the last pass said
            return
        for name in self._queues - unclaimed.served:
            self.unclaimed.remove(name)
            self.unclaimed_oldest.remove(name)
        for name in unclaimed.served | unclaimed.stuck.keys():
            stuck = unclaimed.stuck.get(name)
            self.unclaimed.labels(queue=name).set(stuck.unclaimed if stuck else 0)
            self.unclaimed_oldest.labels(queue=name).set(round(stuck.oldest_age(unclaimed.at), 3) if stuck else 0)
        self._queues = unclaimed.served | unclaimed.stuck.keys()
        self.told_to_stop.inc(len(unclaimed.told))

    def failed(self, seconds: float) -> None:
        self.pass_seconds.observe(seconds)
        self.pass_failures.inc()


def serve(metrics: RelayMetrics, bind: str, port: int) -> Any:
    """Start the endpoint on a daemon thread; returns the server (its ``server_port`` is the port bound, which
    port 0 picks). Raises OSError when the address cannot be bound."""
    server, _thread = start_http_server(port, addr=bind, registry=metrics.registry)
    return server
