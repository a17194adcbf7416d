"""Recovery times of the fault suite: what an on-call engineer waits for once a fault has healed.

A fault test says when the fault healed (Redis back, Postgres back, S3 back) and which milestones follow
it: ``/readyz`` answering 200 again (the ledger) or the API's ``compilesvc_dependency_up`` gauge back at 1
(the broker, the store), the first affected build progressing, every affected build terminal.
A background thread polls each milestone's predicate and stamps when it first holds; the test stamps the
ones it observes itself (:meth:`Recovery.reached`). Where the service records the event's own time (an
error's ``at``, a build's ``finished_at``, a log record's ``ts``: one host, one clock), that time is used
instead of when the poll saw it, so polling latency does not enter the figure. Once the test's assertions
have passed, each time is a figure of the bench table (:func:`bench._table.record`, bench ``faults``):
appended to the file named by ``COMPILESVC_BENCH_RESULTS`` when ``python -m bench.fault_recovery`` runs the
suite, only printed otherwise.

Tests never assert these times (the machine is shared; figures go to benches). A figure's target is derived
from the settings the fault cluster runs with (:class:`Bounds`), and each says how.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import requests
from prometheus_client.parser import text_string_to_metric_families

from bench import _table
from compilesvc.cli.daemon import default_reap_interval
from compilesvc.config.settings import Settings
from tests.faults.scale import SCALE
from tests.workers.conftest import Cluster
from web.server.dependency_health import CHECK_TIMEOUT_SECONDS

BENCH = "faults"
#: docker-compose.yml's healthcheck interval for the api service (the probe of /readyz).
HEALTHCHECK_INTERVAL_SECONDS = 10.0


def process_settings(cluster: Cluster) -> Settings:
    """The settings the cluster's processes run with: its own plus the COMPILESVC_* variables only they get
    (the fault suite's recovery settings)."""
    prefix = "COMPILESVC_"
    fields = {name[len(prefix):].lower(): value for name, value in cluster.env.items()
              if name.startswith(prefix) and name[len(prefix):].lower() in Settings.model_fields}
    return Settings.model_validate(fields)


@dataclass(frozen=True)
class Bounds:
    """Recovery bounds that follow from the settings alone, each with how it follows."""

    settings: Settings

    @property
    def readiness(self) -> tuple[float, str]:
        """The orchestrator probes /readyz every interval: ready again by its second probe after the heal."""
        return 2 * HEALTHCHECK_INTERVAL_SECONDS, \
            f"2 x the api healthcheck interval ({HEALTHCHECK_INTERVAL_SECONDS:g} s, docker-compose.yml)"

    @property
    def dependency_up(self) -> tuple[float, str]:
        """The API checks the broker and the store when scraped, at most once per its metrics cache
        (METRICS_CACHE_SECONDS, 5 s), each check bounded (3 s): up again by the first scrape after both."""
        cache, check = 5.0, CHECK_TIMEOUT_SECONDS
        return cache + check, f"the metrics cache ({cache:g} s) + one check's bound ({check:g} s)"

    @property
    def resend(self) -> tuple[float, str]:
        """A lost compile is a candidate once queued ``grace`` ago, is seen missing at the next reap pass and
        re-sent at the first pass ``grace`` after that (reconcile.py)."""
        grace = self.settings.dispatch_grace_seconds
        reap = default_reap_interval(self.settings)
        passes = math.ceil(grace / reap) * reap
        return grace + reap + passes, (f"grace {grace:g} s + reap interval {reap:g} s + the first pass "
                                       f"{grace:g} s later ({passes:g} s)")

    @property
    def retry_after_heal(self) -> tuple[float, str]:
        """A waiting retry (store or ledger) sleeps at most the backoff cap, then its work (fetch, publish,
        claim of a quick double compile) fits in one lease."""
        cap, lease = self.settings.retry_backoff_max_seconds, self.settings.lease_seconds
        return cap + lease, f"backoff cap {cap:g} s + lease {lease:g} s"

    @property
    def claim_and_compile(self) -> tuple[float, str]:
        """From an accepted submit: the relay sends it, a claim that meets a dead pooled connection is
        retried after at most the backoff cap, and a quick double compile fits in one lease."""
        relay = self.settings.relay_interval_seconds
        cap, lease = self.settings.retry_backoff_max_seconds, self.settings.lease_seconds
        return relay + cap + lease, f"relay interval {relay:g} s + backoff cap {cap:g} s + lease {lease:g} s"


#: When an event happened: True (now, as observed), or its own wall-clock time (epoch seconds, datetime, ISO).
When = bool | float | datetime | str


def epoch(value: float | datetime | str) -> float:
    """Epoch seconds of a wall-clock time as the API (ISO 8601) or a JSON log record (``...Z``) writes it."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()  # the ledger's times are UTC
    return float(value)


@dataclass
class Milestone:
    name: str
    predicate: Callable[[], When | None] | None  # None: the test stamps it (Recovery.reached)
    at_most: float | None
    why: str
    at: float | None = None


def ready(base: str) -> bool:
    """/readyz answers 200 (the ledger reachable)."""
    try:
        return requests.get(f"{base}/readyz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def dependency_up(base: str, dependency: str) -> bool:
    """The API's ``compilesvc_dependency_up{dependency=...}`` is 1 on its /metrics."""
    try:
        answer = requests.get(f"{base}/metrics", timeout=10)
    except requests.RequestException:
        return False
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name == "compilesvc_dependency_up" and sample.labels.get("dependency") == dependency:
                return sample.value == 1.0
    return False


class Recovery:
    """The milestones after one fault; ``with`` it around the test's recovery, :meth:`healed` when the fault
    heals, :meth:`record` after the assertions. Polling stops when every milestone is reached or on exit."""

    def __init__(self, fault: str, cluster: Cluster, healed_what: str, interval: float = 0.25):
        self.fault = fault
        self.healed_what = healed_what
        self.bounds = Bounds(process_settings(cluster))
        self.interval = interval
        self.milestones: dict[str, Milestone] = {}
        self.healed_at: float | None = None
        self._healed_wall = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, predicate: Callable[[], When | None] | None = None,
              bound: tuple[float | None, str] | None = None) -> None:
        at_most, why = bound if bound is not None else (None, "")
        self.milestones[name] = Milestone(name, predicate, at_most, why)

    def healed(self) -> None:
        """The fault has healed: times count from now, and polling starts."""
        self.healed_at, self._healed_wall = time.monotonic(), time.time()
        self._thread = threading.Thread(target=self._poll, name=f"recovery {self.fault}", daemon=True)
        self._thread.start()

    def reached(self, name: str, when: When = True) -> None:
        """Stamp a milestone: now, or at the event's own wall-clock time."""
        milestone = self.milestones[name]
        if milestone.at is None:
            milestone.at = self._monotonic(when)

    def _monotonic(self, when: When) -> float:
        if isinstance(when, bool) or self.healed_at is None:
            return time.monotonic()
        return self.healed_at + (epoch(when) - self._healed_wall)

    def _poll(self) -> None:
        while not self._stop.is_set():
            pending = [m for m in self.milestones.values() if m.predicate is not None and m.at is None]
            if not pending:
                return
            for milestone in pending:
                try:
                    hit = milestone.predicate() if milestone.predicate is not None else None
                except Exception:  # a dependency still down: not reached yet
                    hit = None
                if hit:
                    milestone.at = self._monotonic(hit)
            self._stop.wait(self.interval)

    def __enter__(self) -> Recovery:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def record(self, settle: float = 10.0) -> list[_table.Figure]:
        """The figures (one per milestone reached), after waiting up to ``settle`` seconds for the polled
        ones still pending (they are not the test's concern, only the figure's)."""
        assert self.healed_at is not None, "healed() was never called"
        deadline = time.monotonic() + settle
        while any(m.at is None and m.predicate is not None for m in self.milestones.values()) \
                and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.1)
        figures = []
        for milestone in self.milestones.values():
            if milestone.at is None:
                print(f"recovery: {self.fault}: {milestone.name}: not reached within the test")
                continue
            why = f"; {'target = ' if milestone.at_most is not None else ''}{milestone.why}" if milestone.why else ""
            note = f"{SCALE.name} scale{why}"
            # Below 0: the service recovered before the test's own probe saw the dependency back.
            seconds = max(0.0, milestone.at - self.healed_at)
            figures.append(_table.record(BENCH, f"{self.fault}: {milestone.name}", seconds,
                                         "s", at_most=milestone.at_most, vs=f"from {self.healed_what}",
                                         note=note))
        return figures
