"""One soak from start to verdict, for the test and the bench: the model uploaded, a token per client, the
load (:mod:`tests.soak.load`) with a process sample after the warm-up and another as it ends
(:mod:`tests.soak.procs`), the drain, and what each worker has left running once everything is terminal.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.soak.load import Day, Drained, Tally, run_clients
from tests.soak.procs import Growth, Sample, growth, sample
from tests.soak.stack import SoakStack
from tests.workers.conftest import HLO_MODEL


@dataclass
class SoakResult:
    seconds: float  # how long the load ran
    warmup: float
    clients: int
    tally: Tally
    drained: Drained
    growth: list[Growth]
    samples: dict[str, Sample] = field(default_factory=dict)
    series: list[tuple[float, Sample]] = field(default_factory=list)  # (second of the load, sample), in order
    children_at_start: dict[str, int] = field(default_factory=dict)
    children_after: dict[str, int] = field(default_factory=dict)  # each worker's live descendants, drained
    logged_errors: list[str] = field(default_factory=list)  # ERROR/CRITICAL records of the service's logs
    #: WARNING records by "process: message" (Python's own warnings, celery's "running as root", aside)
    logged_warnings: Counter[str] = field(default_factory=Counter)
    recoveries: list[str] = field(default_factory=list)  # the reaper rescuing compiles: none on a healthy day

    @property
    def errors(self) -> int:
        """Failed requests, plus what the service itself logged as an error (a healthy day logs none)."""
        return self.tally.error_count + len(self.logged_errors)

    @property
    def lost(self) -> int:
        return len(self.drained.lost) + len(self.drained.unpublished)

    def summary(self) -> str:
        t, d = self.tally, self.drained
        lines = [f"soak: {t.total} requests in {self.seconds:.0f} s ({t.total / self.seconds:.1f}/s) from "
                 f"{self.clients} clients, {t.error_count} failed requests, {len(self.logged_errors)} errors logged "
                 f"({self.logged_warnings.total()} warnings), {len(self.recoveries)} recoveries by the reaper, "
                 f"{t.retried_503} submit 503s retried",
                 "  by kind: " + ", ".join(f"{k} {n} (p50 {t.percentile(k, 0.5) * 1000:.0f} ms, "
                                           f"p99 {t.percentile(k, 0.99) * 1000:.0f} ms)"
                                           for k, n in sorted(t.requests.items())),
                 "  submits asked->answered: " + ", ".join(f"{k} {n}" for k, n in sorted(t.outcomes.items())),
                 f"  builds: {d.accepted} accepted, {d.terminal} terminal ({dict(d.states)}), {len(d.lost)} lost, "
                 f"{len(d.unpublished)} succeeded but not published",
                 f"  compile children left after the drain: {self.children_after}"]
        lines += [f"  error: {m}" for m in t.messages[:20]]
        lines += [f"  logged: {m}" for m in self.logged_errors[:20]]
        lines += [f"  recovery: {m}" for m in self.recoveries[:20]]
        lines += [f"  lost: build {b} ({state})" for b, state in list(d.lost.items())[:20]]
        lines += [f"  unpublished: {u}" for u in d.unpublished[:20]]
        return "\n".join(lines)


def upload_model(base: str) -> str:
    response = requests.post(f"{base}/v1/models", data=HLO_MODEL, timeout=60,
                             headers={**bearer(BOOTSTRAP_TOKEN), "Content-Type": "application/octet-stream"})
    if response.status_code not in (200, 201):
        raise RuntimeError(f"model upload answered {response.status_code}: {response.text[:500]}")
    return str(response.json()["uri"])


def soak(stack: SoakStack, seconds: float, *, clients: int = 6, warmup: float | None = None,
         every: float | None = None, drain_timeout: float = 60.0) -> SoakResult:
    """``seconds`` of the day's mix through ``stack``'s proxy. Processes are sampled at ``warmup`` (default:
    a quarter of the run, at most 60 s: imports done, pools and caches filled), as the load ends and, with
    ``every``, every so many seconds between (the series shows a plateau from a steady climb)."""
    warmup = min(seconds / 4, 60.0) if warmup is None else warmup
    tally = Tally()
    day = Day(stack.base, upload_model(stack.base), tally)
    samples: dict[str, Sample] = {}
    series: list[tuple[float, Sample]] = []
    children: dict[str, dict[str, int]] = {}

    def take(name: str, at: float) -> Callable[[], None]:
        def action() -> None:
            samples[name], children[name] = sample(stack)
            series.append((at, samples[name]))
        return action

    points = {warmup: take("start", warmup), seconds: take("end", seconds)}
    if every:
        points.update({at: take(f"at {at:g}", at) for at in itertools.takewhile(
            lambda t: t < seconds, itertools.count(warmup + every, every))})
    ran = run_clients(day, stack.make_tokens(clients), seconds, checkpoints=points)
    admin = requests.Session()
    admin.headers.update(bearer(BOOTSTRAP_TOKEN))
    drained = day.drain(admin, drain_timeout)
    # A compile child lives a moment past its bucket's terminal state (it reports, then exits): give the
    # last ones that moment before counting what is left.
    deadline = time.monotonic() + 10
    while True:
        _, after = sample(stack)
        if not any(after.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    records = [(p.name, r) for p in stack.cluster.processes for r in p.records()]
    logged = [f"{name}: {json.dumps(r)[:400]}" for name, r in records if r.get("level") in ("ERROR", "CRITICAL")]
    warnings = Counter(f"{name.rstrip('0123456789-')}: {r.get('msg')}" for name, r in records
                       if r.get("level") == "WARNING" and r.get("logger") != "py.warnings")
    # A lease that ran out, a compile requeued, failed or cancelled by the reaper, a message sent again: each
    # is the recovery machinery at work, which a day without faults must not need. (A set the reaper
    # publishes is not one: it races the worker finishing the set's last compile, and either may win.)
    recoveries = [f"{name}: {json.dumps(r)[:400]}" for name, r in records
                  if r.get("msg") == "lease expired"
                  or (r.get("msg") == "reaper pass" and any(r.get(k) for k in ("requeued", "failed", "cancelled",
                                                                               "resent")))]
    return SoakResult(seconds=ran, warmup=warmup, clients=clients, tally=tally, drained=drained,
                      growth=growth(samples.get("start", {}), samples.get("end", {})), samples=samples, series=series,
                      children_at_start=children.get("start", {}), children_after=after, logged_errors=logged,
                      logged_warnings=warnings, recoveries=recoveries)
