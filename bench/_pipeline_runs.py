"""One build of bench.pipeline, submitted and followed to its end (not a bench itself): the specs it submits
(fresh shapes each), the host's CPU use meanwhile, and where a one-bucket build's end-to-end time went.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._cluster import Finished, Stack, Submitted, timestamp
from compilesvc.demo import demo_spec

PARALLEL_BATCHES = (1, 2, 4, 8)  # the four buckets of b.; c. uses the first three
FIFTH_BATCH = 16  # the bucket d. adds to b.'s four


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
    spec: dict[str, Any]

    @property
    def compiled_here(self) -> int:
        """Buckets this build compiled: those claimed after its submit (reused ones were claimed before)."""
        return sum((timestamp(b["started_at"]) or 0.0) >= self.submitted.sent for b in self.doc["buckets"])

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



# -- specs ------------------------------------------------------------------------------------------------


def cpu_spec(uri: str, backend: str, buckets: list[tuple[int, int]]) -> dict[str, Any]:
    """The demo spec with the uploaded model, ``backend`` and these (batch, seq) buckets."""
    spec = demo_spec()
    spec["model"]["uri"] = uri
    spec["compiler"] = {"backend": backend, "args": ["--freeze"] if backend == "torchscript" else []}
    spec["buckets"] = [{"batch_size": b, "seq_len": s} for b, s in buckets]
    spec["labels"] = {"source": "bench.pipeline"}
    return spec


def double_spec(stack: Stack, seconds: float, seq: int,
                batches: tuple[int, ...] = PARALLEL_BATCHES) -> dict[str, Any]:
    """Buckets (four by default) for the Neuron SDK test double's neuronx-cc path, each compile waiting
    ``seconds``."""
    spec = stack.cluster.hlo_spec(behaviour=f"slow:{seconds:g}", buckets=len(batches))
    spec["buckets"] = [{"batch_size": b, "seq_len": seq} for b in batches]
    return spec


# -- measurements -----------------------------------------------------------------------------------------


def run_build(stack: Stack, spec: dict[str, Any], compiler: str, slots: int, poll: float, timeout: float) -> Run:
    meter = LoadMeter(stack)
    submitted = stack.submit(spec)
    if submitted.body["outcome"] != "new":
        raise RuntimeError(f"expected a new build, got {submitted.body['outcome']}: the shapes were not fresh")
    finished = stack.wait_finished(submitted.build_id, poll=poll, timeout=timeout)
    run = Run(compiler, slots, submitted, finished, meter.stop(), spec)
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
