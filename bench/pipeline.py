"""Pipeline: the service's overhead around a real compile, bucket parallelism, and one compile per bucket under
concurrent identical submits. ``python -m bench.pipeline [--parts abc] [--rounds 2] [--skip-aoti] [--keep]``

Runs the production stack (:mod:`bench._cluster`: ``compilesvc serve`` under gunicorn, ``compilesvc relay``
and ``compilesvc worker`` processes on a fresh Postgres database, Redis under a unique key prefix and a local
artifact store). Builds are submitted over HTTP (the bundled demo model, :mod:`compilesvc.demo`, uploaded with
POST /v1/models) and followed by polling GET /v1/builds/{id} every ``--poll`` seconds. Every spec uses bucket
shapes not used before in the run, on a fresh ledger and store: every compile is real, never a cache hit.

a. **Service overhead.** A one-bucket cpu ``aotinductor`` build (a real native compile, ~20 s). End to end =
   from just before the POST to the poll that sees ``succeeded``; overhead = end to end - the bucket's
   ``compile_seconds`` (the compile child's own timing, torch import included). The overhead is broken down
   from the ledger's times and the worker's log lines. Target: overhead <= 10% of the measured compile time
   (median over ``--rounds``); it is also shown as a fraction of a nominal 20 s compile.
b. **Bucket parallelism.** A four-bucket build on a worker with 2 slots (``-c 2``) vs the same work with fresh
   keys on one slot; wall time = from just before the POST to the build's ``finished_at`` in the ledger (so
   polling, every ``--parallel-poll`` s here, neither delays it nor takes much CPU from the compiles).
   Target: serial / parallel wall time >= 1.8. Measured with the real compiler
   (aotinductor; the worker gets TORCHINDUCTOR_COMPILE_THREADS=1 so each compile keeps to one core, as a
   2-slot worker on 2 cores should: ``--compile-threads``) and with the Neuron SDK TEST DOUBLE
   (``tests/doubles``, backend neuronx-cc, compiler behaviour ``slow:N``: it waits N seconds using no CPU),
   which isolates the service's own dispatch parallelism from a CPU-bound compiler on a small host. Every row
   names the compiler it used; the double's numbers say nothing about real compile times.
c. **Dedupe.** ``--submits`` concurrent POSTs (one thread and connection each, released together) of one
   never-built three-bucket cpu torchscript spec. Reports the distinct build ids, the outcomes, the
   bucket_compiles rows added, the compile attempts that really ran (sum of ``attempts``, ``running``
   transitions in ``events``, "compile claimed" worker log lines) and the submit latency p50/p95. PASS iff
   exactly one "new" outcome and one compile per bucket.

The "stack cpu" / "other cpu" columns say how busy the host was meanwhile (by the service and its compilers /
by anything else): on a small shared host, CPU-bound compiles slow each other and are slowed by other work.
About 3.5 minutes with the defaults on 2 cores; ``--parts``, ``--rounds``, ``--skip-aoti`` shorten it.

Exit status 1 when a target is missed. Every process started is killed and the database and the Redis keys
removed, also on failure or Ctrl-C (``--keep`` keeps the work directory with every process's log).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import func, select

from bench._cluster import Finished, Stack, Submitted, running_stack, timestamp
from compilesvc.demo import demo_model_bytes, demo_spec
from compilesvc.dispatch import queue_name
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, Event, Outbox
from tests.workers.conftest import NEURON_SDK, wait_for

OVERHEAD_TARGET = 0.10  # overhead / compile time, at most
SPEEDUP_TARGET = 1.8  # serial / parallel wall time, at least
NOMINAL_COMPILE = 20.0  # seconds: "a ~20 s compile"
PARALLEL_BATCHES = (1, 2, 4, 8)  # the four buckets of b.; c. uses the first three
REAL = "aotinductor (real compiler)"


def _cpu_ticks() -> tuple[int, int]:
    """(total, idle) jiffies of the whole host since boot (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(values), values[3] + values[4]


@dataclass(frozen=True)
class Load:
    """CPU use while a build ran, as fractions of all the host's CPUs: ``host`` everything, ``stack`` the
    service's processes and their compilers (not Postgres or Redis), so ``host - stack`` is mostly load from
    elsewhere on the (shared) host, which slows compiles down."""

    host: float
    stack: float

    @property
    def elsewhere(self) -> float:
        return max(0.0, self.host - self.stack)


class LoadMeter:
    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._ticks = _cpu_ticks()
        self._cpu = stack.cpu_seconds()
        self._wall = time.monotonic()

    def stop(self) -> Load:
        total, idle = _cpu_ticks()
        elapsed = total - self._ticks[0]
        host = 1.0 - (idle - self._ticks[1]) / elapsed if elapsed else float("nan")
        wall = (time.monotonic() - self._wall) * (os.cpu_count() or 1)
        return Load(host, (self._stack.cpu_seconds() - self._cpu) / wall)


class FreshShapes:
    """Sequence lengths not used before in this run (the demo model takes 2..128), multiples of 8 first so that
    compared runs do the same work; each spec takes one, so its bucket keys are new."""

    def __init__(self) -> None:
        self._seqs: Iterator[int] = iter([*range(16, 129, 8), *(s for s in range(17, 129) if s % 8)])

    def take(self) -> int:
        return next(self._seqs)


@dataclass
class Run:
    """One build, submitted and followed to its end."""

    compiler: str
    slots: int
    submitted: Submitted
    finished: Finished
    load: Load

    @property
    def doc(self) -> dict[str, Any]:
        return self.finished.doc

    @property
    def wall(self) -> float:
        return self.finished.observed - self.submitted.sent

    @property
    def ledger_wall(self) -> float:
        """From just before the POST to the build's finished_at in the ledger (no polling delay)."""
        return (timestamp(self.doc["finished_at"]) or float("nan")) - self.submitted.sent

    @property
    def compile_seconds(self) -> list[float]:
        return [float(b["compile_seconds"] or 0.0) for b in self.doc["buckets"]]

    @property
    def most_running(self) -> int:
        """Most bucket compiles running at once (from the ledger's started/finished times)."""
        marks = sorted(
            [(timestamp(b["started_at"]) or 0.0, 1) for b in self.doc["buckets"]]
            + [(timestamp(b["finished_at"]) or 0.0, -1) for b in self.doc["buckets"]]
        )
        running = most = 0
        for _, step in marks:
            running += step
            most = max(most, running)
        return most


@dataclass
class Dedupe:
    submits: list[Submitted | Exception]
    key: str
    outcomes: Counter[str]
    rows_added: int
    artifacts_added: int
    attempts: int
    running_transitions: int
    claimed: int
    duplicate_deliveries: int
    dispatches: int
    states: Counter[str] = field(default_factory=Counter)

    @property
    def ok_submits(self) -> list[Submitted]:
        return [s for s in self.submits if isinstance(s, Submitted)]

    @property
    def passed(self) -> bool:
        n = len(self.submits)
        return (len(self.ok_submits) == n and len({s.build_id for s in self.ok_submits}) == n
                and self.outcomes["new"] == 1 and self.rows_added == 3 and self.attempts == 3
                and self.running_transitions == 3 and self.claimed == 3 and self.states == Counter(succeeded=n))


# -- specs ------------------------------------------------------------------------------------------------


def cpu_spec(uri: str, backend: str, buckets: list[tuple[int, int]]) -> dict[str, Any]:
    """The demo spec with the uploaded model, ``backend`` and these (batch, seq) buckets."""
    spec = demo_spec()
    spec["model"]["uri"] = uri
    spec["compiler"] = {"backend": backend, "args": ["--freeze"] if backend == "torchscript" else []}
    spec["buckets"] = [{"batch_size": b, "seq_len": s} for b, s in buckets]
    spec["labels"] = {"source": "bench.pipeline"}
    return spec


def double_spec(stack: Stack, seconds: float, seq: int) -> dict[str, Any]:
    """Four buckets for the Neuron SDK test double's neuronx-cc path, each compile waiting ``seconds``."""
    spec = stack.cluster.hlo_spec(behaviour=f"slow:{seconds:g}", buckets=len(PARALLEL_BATCHES))
    spec["buckets"] = [{"batch_size": b, "seq_len": seq} for b in PARALLEL_BATCHES]
    return spec


# -- measurements -----------------------------------------------------------------------------------------


def run_build(stack: Stack, spec: dict[str, Any], compiler: str, slots: int, poll: float, timeout: float) -> Run:
    meter = LoadMeter(stack)
    submitted = stack.submit(spec)
    if submitted.body["outcome"] != "new":
        raise RuntimeError(f"expected a new build, got {submitted.body['outcome']}: the shapes were not fresh")
    finished = stack.wait_finished(submitted.build_id, poll=poll, timeout=timeout)
    run = Run(compiler, slots, submitted, finished, meter.stop())
    if finished.doc["state"] != "succeeded":
        failed = [(b["state"], b["error_code"], b["error_message"]) for b in finished.doc["buckets"]]
        raise RuntimeError(f"{compiler} build {submitted.build_id} ended {finished.doc['state']}: {failed}")
    return run


BREAKDOWN = ("submit", "dispatch", "prepare", "child start", "compile", "publish", "finalize", "notice")
LEGEND = """stack cpu / other cpu: share of all CPUs used by the service's processes (compilers included) / by
  everything else on the host (Postgres, Redis, other users) during the build.
columns after them (seconds), from client, ledger and worker-log times: submit = the POST;
  dispatch = response -> bucket claimed (relay, Redis, worker); prepare = claimed -> compile child started
  (lease, model fetch); child start = the child's wall time - compile_seconds (interpreter start before the
  child's clock); compile = compile_seconds; publish = child exited -> bucket succeeded (files, manifest,
  ledger); finalize = bucket -> build succeeded (artifact manifest); notice = build finished -> the poll that
  saw it; other = e2e - the sum (clock skew between log lines)"""


def breakdown(stack: Stack, run: Run) -> dict[str, float]:
    """Where the end-to-end time of a one-bucket build went, in seconds (see :data:`LEGEND`)."""
    (bucket,) = run.doc["buckets"]
    started = [r for r in stack.worker_records("compiler started") if r.get("bucket_key") == bucket["key"]]
    ended = [r for r in stack.worker_records("compiler finished") if r.get("bucket_key") == bucket["key"]]
    if len(started) != 1 or len(ended) != 1:
        raise RuntimeError(f"expected one compiler start and finish for bucket {bucket['key'][:12]} in the worker "
                           f"logs, found {len(started)} and {len(ended)}")
    claimed, succeeded = timestamp(bucket["started_at"]), timestamp(bucket["finished_at"])
    child_started, child_ended = timestamp(started[0]["ts"]), timestamp(ended[0]["ts"])
    built = timestamp(run.doc["finished_at"])
    assert None not in (claimed, succeeded, child_started, child_ended, built)
    compile_seconds = float(bucket["compile_seconds"])
    parts = {
        "submit": run.submitted.latency,
        "dispatch": claimed - run.submitted.answered,  # type: ignore[operator]
        "prepare": child_started - claimed,  # type: ignore[operator]
        "child start": float(ended[0]["seconds"]) - compile_seconds,
        "compile": compile_seconds,
        "publish": succeeded - child_ended,  # type: ignore[operator]
        "finalize": built - succeeded,  # type: ignore[operator]
        "notice": run.finished.observed - built,  # type: ignore[operator]
    }
    parts["other"] = run.wall - sum(parts.values())
    return parts


def dedupe(stack: Stack, spec: dict[str, Any], n: int, poll: float, timeout: float) -> Dedupe:
    def count(model: Any) -> int:
        with stack.services.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(model)) or 0)

    rows_before, artifacts_before = count(BucketCompile), count(Artifact)
    barrier = threading.Barrier(n)
    results: list[Submitted | Exception] = [RuntimeError("no answer")] * n

    def submit(index: int) -> None:
        with requests.Session() as session:  # one client, one connection each
            try:
                barrier.wait(60)
                results[index] = stack.submit(spec, session=session)
            except Exception as exc:
                results[index] = exc

    threads = [threading.Thread(target=submit, args=(i,), name=f"submit-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    answered = [r for r in results if isinstance(r, Submitted)]
    if not answered:
        raise RuntimeError(f"every concurrent submit failed, e.g. {results[0]!r}")
    key = answered[0].body["artifact_key"]
    stack.wait_finished(answered[0].build_id, poll=poll, timeout=timeout)

    def all_finished() -> bool:
        with stack.services.sessions() as session:
            return not session.scalar(select(func.count()).select_from(Build)
                                      .where(Build.artifact_key == key, Build.state == "building"))

    wait_for(all_finished, 60, "every build of the deduped artifact to finish")
    time.sleep(1.0)  # a duplicate delivery would be claimed (or refused) within this
    with stack.services.sessions() as session:
        builds = session.execute(select(Build.outcome, Build.state).where(Build.artifact_key == key)).all()
        bucket_ids = list(session.scalars(
            select(ArtifactBucket.bucket_compile_id).join(Artifact, Artifact.id == ArtifactBucket.artifact_id)
            .where(Artifact.key == key)))
        buckets = list(session.scalars(select(BucketCompile).where(BucketCompile.id.in_(bucket_ids))))
        running = session.scalar(select(func.count()).select_from(Event).where(
            Event.entity == "bucket", Event.entity_id.in_(bucket_ids), Event.to_state == "running"))
        dispatches = session.scalar(select(func.count()).select_from(Outbox)
                                    .where(Outbox.bucket_compile_id.in_(bucket_ids)))
    keys = {b.key for b in buckets}
    return Dedupe(
        submits=results, key=key,
        outcomes=Counter(outcome for outcome, _ in builds),
        states=Counter(state for _, state in builds),
        rows_added=count(BucketCompile) - rows_before, artifacts_added=count(Artifact) - artifacts_before,
        attempts=sum(b.attempts for b in buckets), running_transitions=int(running or 0),
        claimed=sum(r.get("bucket_key") in keys for r in stack.worker_records("compile claimed")),
        duplicate_deliveries=sum(r.get("bucket_compile_id") in bucket_ids
                                 for r in stack.worker_records("duplicate delivery: nothing to claim")),
        dispatches=int(dispatches or 0),
    )


# -- report -----------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_overhead(stack: Stack, runs: list[Run]) -> tuple[float, str]:
    print(f"\na. service overhead around a real compile: cpu aotinductor, demo model, 1 bucket "
          f"({len(runs)} round{'s' * (len(runs) != 1)}, fresh key each)")
    head = (f"{'round':<6}{'bucket':>9}{'e2e s':>8}{'compile s':>10}{'overhead s':>11}{'x compile':>10}"
            f"{'x 20 s':>8}{'stack cpu':>10}{'other cpu':>10}  " + " ".join(f"{p:>11}" for p in (*BREAKDOWN, "other")))
    print(head)
    ratios, overheads, compiles = [], [], []
    for index, run in enumerate(runs, 1):
        parts = breakdown(stack, run)
        compile_seconds = parts["compile"]
        overhead = run.wall - compile_seconds
        ratios.append(overhead / compile_seconds)
        overheads.append(overhead)
        compiles.append(compile_seconds)
        shape = run.doc["buckets"][0]["inputs"][0]["shape"]
        print(f"{index:<6}{shape!s:>9}{run.wall:>8.2f}{compile_seconds:>10.2f}{overhead:>11.2f}"
              f"{overhead / compile_seconds:>10.3f}{overhead / NOMINAL_COMPILE:>8.3f}{run.load.stack:>10.0%}"
              f"{run.load.elsewhere:>10.0%}  "
              + " ".join(f"{parts[p]:>11.3f}" for p in (*BREAKDOWN, "other")))
    ratio = statistics.median(ratios)
    overhead = statistics.median(overheads)
    print(f"median: overhead {overhead:.2f} s = {ratio:.3f} x the measured compile "
          f"({statistics.median(compiles):.1f} s)"
          f" = {overhead / NOMINAL_COMPILE:.3f} x a {NOMINAL_COMPILE:.0f} s compile; target <= {OVERHEAD_TARGET:.2f}"
          f" x compile: {verdict(ratio <= OVERHEAD_TARGET)}")
    print(LEGEND)
    return ratio, verdict(ratio <= OVERHEAD_TARGET)


def print_parallel(pairs: list[tuple[str, Run, Run]]) -> list[tuple[str, float, str]]:
    print(f"\nb. bucket parallelism: {len(PARALLEL_BATCHES)} buckets, one worker with 2 slots vs 1 slot, "
          f"fresh keys each (wall = submit -> the build's finished_at in the ledger)")
    print(f"{'compiler':<44}{'slots':>6}{'wall s':>8}{'compile s each':>26}{'most running':>13}{'stack cpu':>10}"
          f"{'other cpu':>10}")
    results = []
    for compiler, parallel, serial in pairs:
        for run in (parallel, serial):
            each = " ".join(f"{s:.1f}" for s in run.compile_seconds)
            print(f"{compiler:<44}{run.slots:>6}{run.ledger_wall:>8.2f}{each:>26}{run.most_running:>13}"
                  f"{run.load.stack:>10.0%}{run.load.elsewhere:>10.0%}")
    for compiler, parallel, serial in pairs:
        speedup = serial.ledger_wall / parallel.ledger_wall
        inflation = statistics.mean(parallel.compile_seconds) / statistics.mean(serial.compile_seconds)
        ok = speedup >= SPEEDUP_TARGET
        print(f"speedup, {compiler}: {serial.ledger_wall:.2f} / {parallel.ledger_wall:.2f} = {speedup:.2f}x; target >= "
              f"{SPEEDUP_TARGET:.1f}x: {verdict(ok)}  (each compile took {inflation:.2f}x as long with 2 slots busy "
              f"as with 1; the host's CPUs were {parallel.load.host:.0%} busy during the 2-slot build)")
        results.append((compiler, speedup, verdict(ok)))
    return results


def print_dedupe(result: Dedupe) -> str:
    n = len(result.submits)
    ok = result.ok_submits
    latencies = sorted(s.latency for s in ok)
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    errors = [r for r in result.submits if not isinstance(r, Submitted)]
    print(f"\nc. {n} identical concurrent submits of a never-built 3-bucket spec (cpu torchscript, demo model)")
    print(f"build ids: {len({s.build_id for s in ok})} distinct of {n} answers ({len(errors)} failed"
          f"{': ' + repr(errors[0]) if errors else ''}); HTTP statuses {dict(Counter(s.status for s in ok))}")
    print(f"outcomes: {dict(result.outcomes)} (want exactly 1 new); builds now {dict(result.states)}")
    print(f"artifacts rows added: {result.artifacts_added}; bucket_compiles rows added: {result.rows_added} (want 3)")
    print(f"compiles run: sum(attempts) {result.attempts}, 'running' transitions in events "
          f"{result.running_transitions}, 'compile claimed' worker log lines {result.claimed} (want 3 each); "
          f"dispatch messages (outbox rows) {result.dispatches}, duplicate deliveries {result.duplicate_deliveries}")
    print(f"submit latency: p50 {q[9] * 1000:.0f} ms, p95 {q[18] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    print(f"exactly one compile per bucket: {verdict(result.passed)}")
    return verdict(result.passed)


# -- main -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="abc", help="which measurements to run, e.g. 'b' or 'ac' (default abc)")
    parser.add_argument("--rounds", type=int, default=2, help="one-bucket aotinductor builds for the overhead (a)")
    parser.add_argument("--skip-aoti", action="store_true",
                        help="b. without the real compiler (its slowest part, ~2.5 min); a. still uses it")
    parser.add_argument("--double-seconds", type=float, default=6.0,
                        help="seconds each test-double compile waits in b. (0: no test double)")
    parser.add_argument("--submits", type=int, default=32, help="concurrent identical submits (c)")
    parser.add_argument("--compile-threads", type=int, default=1,
                        help="TORCHINDUCTOR_COMPILE_THREADS for the workers (0: leave unset)")
    parser.add_argument("--poll", type=float, default=0.05,
                        help="seconds between GET /v1/builds/{id} polls in a. and c.")
    parser.add_argument("--parallel-poll", type=float, default=1.0,
                        help="the same in b., whose wall times come from the ledger (polls cost CPU the compiles "
                             "need)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a build may take")
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--api-threads", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (every process's log)")
    args = parser.parse_args(argv)
    parts = set(args.parts)
    if not parts or parts - set("abc"):
        parser.error("--parts takes letters of 'abc'")
    if args.rounds < 1 or args.submits < 1:
        parser.error("--rounds and --submits must be at least 1")
    compilers = [] if "b" not in parts else [
        *([] if args.skip_aoti else [REAL]),
        *([f"neuronx-cc TEST DOUBLE (slow:{args.double_seconds:g}, no CPU)"] if args.double_seconds > 0 else []),
    ]
    if parts == {"b"} and not compilers:
        parser.error("nothing to measure: b. without the real compiler (--skip-aoti) and without the double")

    worker_env = {"TORCHINDUCTOR_COMPILE_THREADS": str(args.compile_threads)} if args.compile_threads else {}
    double_queue = queue_name("inf2", NEURON_SDK, "neuronx-cc") if len(compilers) > (REAL in compilers) else None
    shapes = FreshShapes()
    loadavg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.monotonic()
    overhead_runs: list[Run] = []
    dedupe_result: Dedupe | None = None
    parallel: dict[str, Run] = {}
    serial: dict[str, Run] = {}
    with running_stack(api_workers=args.api_workers, api_threads=args.api_threads, keep=args.keep) as stack:
        print(f"compilesvc pipeline: gunicorn {args.api_workers}x{args.api_threads} threads, relay, workers on "
              f"{os.cpu_count()} CPUs shared with everything else on the host (load average at start {loadavg}); "
              f"Postgres {stack.pg_url.rsplit('/', 1)[1]}, Redis prefix {stack.prefix}, local store; "
              f"worker env {worker_env or 'as is'}", flush=True)
        uri = stack.upload_model(demo_model_bytes())

        def build(compiler: str, slots: int, batches: tuple[int, ...], poll: float) -> Run:
            seq = shapes.take()
            if compiler == REAL:
                spec = cpu_spec(uri, "aotinductor", [(b, seq) for b in batches])
            else:
                spec = double_spec(stack, args.double_seconds, seq)
            return run_build(stack, spec, compiler, slots, poll, args.timeout)

        def step(what: str) -> None:
            print(f"[{time.monotonic() - started:6.1f} s] {what} ...", flush=True)

        step("starting workers with 2 slots")
        stack.start_workers(2, worker_env, double_queue)
        for index in range(args.rounds if "a" in parts else 0):
            step(f"a. round {index + 1}: one-bucket aotinductor build")
            overhead_runs.append(build(REAL, 2, (1,), args.poll))
        if "c" in parts:
            step(f"c. {args.submits} concurrent identical submits")
            seq = shapes.take()
            dedupe_spec = cpu_spec(uri, "torchscript", [(b, seq) for b in PARALLEL_BATCHES[:3]])
            dedupe_result = dedupe(stack, dedupe_spec, args.submits, args.poll, args.timeout)
        for compiler in compilers:
            step(f"b. 4-bucket build, 2 slots, {compiler}")
            parallel[compiler] = build(compiler, 2, PARALLEL_BATCHES, args.parallel_poll)
        if compilers:
            step("restarting workers with 1 slot")
            stack.start_workers(1, worker_env, double_queue)
        for compiler in compilers:
            step(f"b. 4-bucket build, 1 slot, {compiler}")
            serial[compiler] = build(compiler, 1, PARALLEL_BATCHES, args.parallel_poll)

        rows: list[tuple[str, str, str, str]] = []
        if overhead_runs:
            ratio, result = print_overhead(stack, overhead_runs)
            rows.append(("a. overhead / measured compile time (median)", f"{ratio:.3f}",
                         f"<= {OVERHEAD_TARGET:.2f}", result))
        if compilers:
            for compiler, speedup, result in print_parallel([(c, parallel[c], serial[c]) for c in compilers]):
                rows.append((f"b. speedup 2 slots vs 1, {compiler}", f"{speedup:.2f}x", f">= {SPEEDUP_TARGET:.1f}x",
                             result))
        if dedupe_result is not None:
            rows.append((f"c. compiles run for 3 buckets, {args.submits} concurrent submits",
                         f"{dedupe_result.running_transitions}", "== 3", print_dedupe(dedupe_result)))

    loadavg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nsummary ({time.monotonic() - started:.0f} s; load average at end {loadavg})")
    for name, value, target, result in rows:
        print(f"{name:<70}{value:>8}  {target:>8}  {result}")
    if "b" in parts and args.skip_aoti:
        print("(b. without the real compiler: --skip-aoti)")
    runs = [*overhead_runs, *parallel.values(), *serial.values()]
    busiest = max((run.load.elsewhere for run in runs), default=0.0)
    if busiest > 0.15:
        print(f"note: other work used up to {busiest:.0%} of the host's CPUs during a build; compile times, and so "
              f"the real compiler's speedup, are pessimistic")
    return 1 if any(row[3] != "PASS" for row in rows) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}); everything started was stopped", file=sys.stderr)
        sys.exit(130)
