"""Every bench, one after the other: ``python -m bench.run_all [--quick] [--only NAME ...]`` (what ``make bench`` runs).

Each bench module runs as its own subprocess (``python -m bench.<name>``, from the repository root, with this
interpreter), its output streamed as it comes; then one summary line per bench: PASS/FAIL, exit code and
wall time, and the one table of every figure the benches recorded (:mod:`bench._table`), with its target,
its baseline and the host's cores and load. Exit status 1 if any bench failed (130 when interrupted).

Defaults are each bench's own, which suit a 2-core host: api_throughput ~3 min (both ledgers), pipeline ~7 min
(two direct compiles beside the service's, 500 concurrent submits), stream_memory (1 GiB blob, then a served
upload) ~2 min, fleet_fetch (256 MiB, then 2 x 10 s of wrk) ~2 min, llm_artifact (a 4 GiB NxDI-shaped directory
published into a local and an S3 store, then 3 cold fetches beside curl; ~9 GiB of disk at the peak) 4-7 min,
history_scale (1,000,000 builds) several minutes, soak 10 min, fault_recovery (the fault suite's heavy variant:
60 s S3 outages, 12 builds lost with Redis) ~6 min, fuzz (5,000 schemathesis cases per ledger) ~3 min, signing
(64 MiB cached artifact) ~10 s, archive_headers (the API refusing archives whose header declares 1 GiB) ~2 s.
``--quick`` passes smaller sizes (:data:`QUICK`) for a smoke run of a few minutes in all.

Ctrl-C or SIGTERM is passed on to the running bench once (each bench runs in its own process group, so it is
signalled exactly once and cleans up what it started: databases, servers, Redis keys), then the run stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from bench import _table

ROOT = Path(__file__).resolve().parent.parent
BENCHES = ("api_throughput", "pipeline", "stream_memory", "fleet_fetch", "llm_artifact", "history_scale",
           "scaler_query", "db_preping", "soak", "fault_recovery", "fuzz", "sandbox_cost", "signing",
           "archive_headers")
QUICK: dict[str, list[str]] = {
    "api_throughput": ["--duration", "2", "--rounds", "1"],
    "pipeline": ["--rounds", "1", "--skip-aoti", "--double-seconds", "5", "--submits", "50", "--client-processes",
                 "2"],
    "stream_memory": ["--size-mib", "128"],
    "fleet_fetch": ["--size-mib", "64", "--rounds", "1", "--lookup-seconds", "3"],
    "llm_artifact": ["--size-mib", "128", "--rounds", "1"],
    "history_scale": ["--rows", "100000", "--reps", "50"],
    "scaler_query": ["--rows", "100000", "--reps", "200"],
    "db_preping": ["--transactions", "300", "--rounds", "3"],
    "soak": ["--seconds", "60", "--every", "15"],
    "fault_recovery": ["--scale", "ci"],
    "fuzz": ["--cases", "300"],
    "sandbox_cost": ["--starts", "10", "--rounds", "1"],
    "signing": ["--size-mib", "16", "--rounds", "5"],
    "archive_headers": [],
}


def run(name: str, args: list[str]) -> tuple[int, float]:
    """Run one bench to completion; returns (exit code, seconds). A signal to us is forwarded to it once."""
    command = [sys.executable, "-m", f"bench.{name}", *args]
    print(f"\n=== {' '.join(['python', '-m', f'bench.{name}', *args])}", flush=True)
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    forwarded: list[int] = []

    def stop(signum: int) -> None:
        if procs[0].poll() is None:
            os.killpg(procs[0].pid, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not forwarded:
            forwarded.append(signum)
            if procs:
                stop(signum)

    # Installed before the bench starts: a signal that came between its start and the handlers would end
    # this process and leave the bench (in a process group of its own) running with nobody to stop it.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        procs.append(subprocess.Popen(command, cwd=ROOT, process_group=0))
        if forwarded:  # signalled while it started: it has its process group now
            stop(forwarded[0])
        code = procs[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if forwarded:
        raise KeyboardInterrupt(code)
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes for every bench (a smoke run)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, metavar="NAME",
                        help=f"run only these ({', '.join(BENCHES)})")
    args = parser.parse_args(argv)

    names = [name for name in BENCHES if not args.only or name in args.only]
    host = _table.machine()  # before the benches load the host
    results_file = Path(tempfile.mkstemp(prefix="compilesvc-bench-", suffix=".jsonl")[1])
    os.environ[_table.RESULTS_ENV] = str(results_file)
    results: list[tuple[str, list[str], int, float]] = []
    interrupted = False
    for name in names:
        bench_args = QUICK[name] if args.quick else []
        started = time.monotonic()
        try:
            code, seconds = run(name, bench_args)
        except KeyboardInterrupt as exc:
            code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 130
            results.append((name, bench_args, code, time.monotonic() - started))
            interrupted = True
            break
        results.append((name, bench_args, code, seconds))

    print(f"\n=== summary{' (--quick)' if args.quick else ''}")
    for index, (name, bench_args, code, seconds) in enumerate(results):
        status = "INTERRUPTED" if interrupted and index == len(results) - 1 else "PASS" if code == 0 else "FAIL"
        print(f"{name:<16} {status:<4}  exit {code:>3}  {seconds:>6.0f} s  {' '.join(bench_args)}".rstrip())
    for name in names[len(results):]:
        print(f"{name:<16} not run (interrupted)")
    figures = _table.load(results_file)
    results_file.unlink(missing_ok=True)
    print(f"\n=== every figure{' (--quick: smaller sizes than the targets assume)' if args.quick else ''}\n")
    print(_table.render(figures, host))
    for figure in _table.missed(figures):
        print(f"MISSED: {figure.bench} {figure.name}: {figure.note or 'no explanation recorded'}")
    if interrupted:
        return 130
    return 1 if any(code != 0 for _, _, code, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
