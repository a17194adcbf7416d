"""bench.pipeline's part c (not a bench itself): many concurrent identical submits of a never-built spec, and
how many compiles they caused, counted three ways from the ledger and the workers' logs.

The submits come from client processes (:mod:`bench._submit_clients`), released together, over the API's
gunicorn workers (``--api-workers``): the figure is about the service deduplicating across processes, not
about one process's lock.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from bench._cluster import Stack, Submitted
from bench._submit_clients import submit_all
from bench._table import record
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, Event, Outbox
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.fixtures.waiting import wait_for

BENCH = "pipeline"


@dataclass
class Dedupe:
    submits: list[Submitted | Exception]
    key: str
    buckets: int  # in the spec
    api_workers: int
    client_processes: int
    outcomes: Counter[str]
    rows_added: int
    artifacts_added: int
    attempts: int
    running_per_bucket: list[int]  # 'running' transitions in events, per bucket of the artifact
    claimed: int
    duplicate_deliveries: int
    dispatches: int
    states: Counter[str] = field(default_factory=Counter)

    @property
    def ok_submits(self) -> list[Submitted]:
        return [s for s in self.submits if isinstance(s, Submitted)]

    @property
    def running_transitions(self) -> int:
        return sum(self.running_per_bucket)

    @property
    def passed(self) -> bool:
        n, b = len(self.submits), self.buckets
        return (len(self.ok_submits) == n and len({s.build_id for s in self.ok_submits}) == n
                and self.outcomes["new"] == 1 and self.rows_added == b and self.attempts == b
                and self.running_per_bucket == [1] * b and self.claimed == b and self.states == Counter(succeeded=n))


def dedupe(stack: Stack, spec: dict[str, Any], n: int, *, api_workers: int, client_processes: int, poll: float,
           timeout: float) -> Dedupe:
    def count(model: Any) -> int:
        with stack.services.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(model)) or 0)

    rows_before, artifacts_before = count(BucketCompile), count(Artifact)
    answers = submit_all(f"{stack.base}/v1/builds", bearer(BOOTSTRAP_TOKEN), spec, n, client_processes, 120)
    results: list[Submitted | Exception] = [
        Submitted(a["status"], a["body"], a["sent"], a["answered"]) if a.get("status") in (200, 202)
        else RuntimeError(a.get("error") or f"HTTP {a.get('status')}: {a.get('body')}") for a in answers]
    answered = [r for r in results if isinstance(r, Submitted)]
    if not answered:
        raise RuntimeError(f"every concurrent submit failed, e.g. {results[0]!r}")
    key = answered[0].body["artifact_key"]
    stack.wait_finished(answered[0].build_id, poll=poll, timeout=timeout)

    def all_finished() -> bool:
        with stack.services.sessions() as session:
            return not session.scalar(select(func.count()).select_from(Build)
                                      .where(Build.artifact_key == key, Build.state == "building"))

    wait_for(all_finished, 120, "every build of the deduped artifact to finish")
    time.sleep(1.0)  # a duplicate delivery would be claimed (or refused) within this
    with stack.services.sessions() as session:
        builds = session.execute(select(Build.outcome, Build.state).where(Build.artifact_key == key)).all()
        bucket_ids = list(session.scalars(
            select(ArtifactBucket.bucket_compile_id).join(Artifact, Artifact.id == ArtifactBucket.artifact_id)
            .where(Artifact.key == key)))
        buckets = list(session.scalars(select(BucketCompile).where(BucketCompile.id.in_(bucket_ids))))
        running = Counter(session.scalars(select(Event.entity_id).where(
            Event.entity == "bucket", Event.entity_id.in_(bucket_ids), Event.to_state == "running")))
        dispatches = session.scalar(select(func.count()).select_from(Outbox)
                                    .where(Outbox.bucket_compile_id.in_(bucket_ids)))
    keys = {b.key for b in buckets}
    return Dedupe(
        submits=results, key=key, buckets=len(spec["buckets"]), api_workers=api_workers,
        client_processes=client_processes,
        outcomes=Counter(outcome for outcome, _ in builds),
        states=Counter(state for _, state in builds),
        rows_added=count(BucketCompile) - rows_before, artifacts_added=count(Artifact) - artifacts_before,
        attempts=sum(b.attempts for b in buckets), running_per_bucket=[running[i] for i in sorted(bucket_ids)],
        claimed=sum(r.get("bucket_key") in keys for r in stack.worker_records("compile claimed")),
        duplicate_deliveries=sum(r.get("bucket_compile_id") in bucket_ids
                                 for r in stack.worker_records("duplicate delivery: nothing to claim")),
        dispatches=int(dispatches or 0),
    )


def print_dedupe(result: Dedupe) -> bool:
    """Prints the detail and records the figures; whether exactly one compile ran per bucket."""
    n, b = len(result.submits), result.buckets
    ok = result.ok_submits
    latencies = sorted(s.latency for s in ok)
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    errors = [r for r in result.submits if not isinstance(r, Submitted)]
    spread = max(s.sent for s in ok) - min(s.sent for s in ok)
    print(f"\nc. {n} identical concurrent submits of a never-built {b}-bucket spec (cpu torchscript, demo model), "
          f"from {result.client_processes} client processes (sent within {spread * 1000:.0f} ms of each other) to "
          f"{result.api_workers} API processes")
    print(f"build ids: {len({s.build_id for s in ok})} distinct of {n} answers ({len(errors)} failed"
          f"{': ' + repr(errors[0]) if errors else ''}); HTTP statuses {dict(Counter(s.status for s in ok))}")
    print(f"outcomes: {dict(result.outcomes)} (want exactly 1 new); builds now {dict(result.states)}")
    print(f"artifacts rows added: {result.artifacts_added}; bucket_compiles rows added: {result.rows_added} "
          f"(want {b})")
    print(f"compiles run: sum(attempts) {result.attempts}, 'running' transitions in events "
          f"{result.running_transitions} (per bucket {result.running_per_bucket}), 'compile claimed' worker log "
          f"lines {result.claimed} (want {b} each); dispatch messages (outbox rows) {result.dispatches}, duplicate "
          f"deliveries {result.duplicate_deliveries}")
    print(f"submit latency: p50 {q[9] * 1000:.0f} ms, p95 {q[18] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    print(f"exactly one compile per bucket: {'PASS' if result.passed else 'MISS'}")
    setup = f"{n} concurrent identical submits over {result.api_workers} API processes"
    record(BENCH, f"c. compiles per bucket (most), {setup}", max(result.running_per_bucket, default=0), "",
           at_most=1, vs=f"{b} buckets in the spec",
           note=f"{result.running_transitions} compiles in all; sum(attempts) {result.attempts}, "
                f"claimed {result.claimed}")
    record(BENCH, f"c. builds that compiled (outcome new), {setup}", result.outcomes["new"], "", at_most=1,
           vs=f"{len(ok)} answered submits, each its own build record",
           note=f"outcomes {dict(result.outcomes)}; p95 latency {q[18] * 1000:.0f} ms")
    record(BENCH, f"c. submits not answered 200/202, {setup}", len(errors), "", at_most=0,
           vs=f"{n} submits", note=repr(errors[0])[:200] if errors else "")
    return result.passed
