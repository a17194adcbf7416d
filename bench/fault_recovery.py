"""How long compilesvc takes to recover from infrastructure faults: the fault suite's heavy variant, timed.

    python -m bench.fault_recovery [--scale heavy|ci] [-k EXPRESSION]

Runs ``pytest -m faults tests/faults`` in a subprocess with ``COMPILESVC_FAULT_SCALE`` set (heavy, the
default: the issue's 60 s S3 outages and 12 builds lost with Redis; ci: the light variant ``make test``
runs) and ``COMPILESVC_BENCH_RESULTS`` passed through. Each fault test records its recovery times from the
heal (Redis, Postgres or S3 back) to /readyz answering 200, the lost compiles re-sent and the affected
builds finished (tests/faults/recovery.py, with the targets it derives from the fault cluster's
settings); this bench adds the suite's wall time and prints the recovery table of the run. Exit status
1 if pytest fails (a correctness failure: the tests assert no timing), 130 when interrupted.

Private Postgres, Redis and S3 servers are the tests' own (started and killed by pid), never the
machine's shared ones. Ctrl-C or SIGTERM is passed to pytest as one SIGINT, so its fixtures tear them down.
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
BENCH = "faults"


def run_suite(scale: str, results: Path, keyword: str | None) -> tuple[int, float]:
    """pytest on the fault suite at ``scale``, figures appended to ``results``; (exit code, seconds)."""
    command = [sys.executable, "-m", "pytest", "-m", "faults", "tests/faults", "-q", "-s", "--durations=0",
               "-p", "no:cacheprovider", *(["-k", keyword] if keyword else [])]
    env = {**os.environ, "COMPILESVC_FAULT_SCALE": scale, _table.RESULTS_ENV: str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"COMPILESVC_FAULT_SCALE={scale} {' '.join(command[2:])}", flush=True)
    interrupted: list[int] = []
    running: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not interrupted:
            interrupted.append(signum)
            if running and running[0].poll() is None:
                os.killpg(running[0].pid, signal.SIGINT)

    # Handlers first: a child inherits an ignored SIGINT (a background job's) but not a handled one, and
    # pytest must turn SIGINT into KeyboardInterrupt to tear its private services down.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    try:
        if not interrupted:
            # Its own process group: a signal meant for us reaches pytest once, as SIGINT.
            running.append(subprocess.Popen(command, cwd=ROOT, env=env, process_group=0))
            if interrupted:  # the signal came while it was starting
                os.killpg(running[0].pid, signal.SIGINT)
            running[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = running[0].returncode if running else 130
    if interrupted:
        raise KeyboardInterrupt
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=("heavy", "ci"), default="heavy",
                        help="heavy: the issue's outage and queue sizes (default); ci: what make test runs")
    parser.add_argument("-k", dest="keyword", help="only the fault tests matching this pytest expression")
    args = parser.parse_args(argv)

    host = _table.machine()
    shared = os.environ.get(_table.RESULTS_ENV)
    results = Path(shared) if shared else Path(tempfile.mkstemp(prefix="compilesvc-faults-", suffix=".jsonl")[1])
    already = len(_table.load(results))  # run_all's file holds the earlier benches' figures
    os.environ[_table.RESULTS_ENV] = str(results)  # this process's own figure (the wall time) too
    try:
        try:
            code, seconds = run_suite(args.scale, results, args.keyword)
        except KeyboardInterrupt:
            return 130
        _table.record(BENCH, f"fault suite wall time ({args.scale} scale)", seconds, "s",
                      vs="pytest -m faults tests/faults, one process", note="private Postgres, Redis, S3 per test")
        figures = [f for f in _table.load(results)[already:] if f.bench == BENCH]
        print(f"\n=== recovery after faults ({args.scale} scale){'' if code == 0 else ': PYTEST FAILED'}\n")
        print(_table.render(figures, host))
        for figure in _table.missed(figures):
            print(f"MISSED: {figure.name}: {figure.note}")
    finally:
        if not shared:
            results.unlink(missing_ok=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
