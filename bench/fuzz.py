"""The OpenAPI conformance fuzz, long: ``python -m bench.fuzz [--cases 5000] [--ledger sqlite postgres]
[--open-reads]``.

The machinery of the CI test (:mod:`tests.web.conformance`: schemathesis against /openapi.json with every
check, each case as one kind of caller: no token, fleet, read, submit, admin; positive and negative cases)
run until at least ``--cases`` requests have been sent on each ledger. The cases counted are the ones
actually sent (an operation without inputs has one case, whatever its budget), so passes are added until
the count is reached; each pass draws new cases.

Per ledger, scope and mode it prints the cases, the statuses answered, the distinct failures and the time;
then each failure with schemathesis' report and curl line (the token shows as ``[Filtered]``: the scope
named with it is the one to send). Figures (:mod:`bench._table`): cases executed (>= 5,000), 5xx answers
(<= 0; the documented 503 with Retry-After excepted, counted in the note), failing cases (<= 0), seconds.
Exit status 1 on any failure or 5xx.

``--open-reads`` runs under the settings that change who needs a token (``open_reads`` on,
``public_metrics`` off): the document must then say so (web.contract.openapi follows the settings).

Submits are neither rate-limited nor held to a compile quota (:func:`tests.web.conformance.fuzz_env`).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import _table
from bench._cluster import interrupt_on_signals
from compilesvc.ledger.migrate import upgrade
from tests.fixtures.ledger import create_pg_database, drop_pg_database
from tests.web.conformance import MODES, SCOPES, Fuzzer, Tally, close_env, fuzz_env, has_inputs

BENCH = "fuzz"
TARGET_CASES = 5000  # issue 12


def run_ledger(ledger: str, database_url: str, workdir: Path, cases: int, **overrides: Any) -> list[Tally]:
    """Passes over every scope and mode until ``cases`` requests were sent; the tallies of every pass."""
    upgrade(database_url)
    env = fuzz_env(workdir, database_url, **overrides)
    tallies: list[Tally] = []
    try:
        fuzzer = Fuzzer(env)
        operations = len(fuzzer.operations) + sum(1 for op in fuzzer.operations if has_inputs(op))
        sent, pass_number = 0, 0
        while sent < cases:
            pass_number += 1
            # Cases per operation and mode, all scopes together; a shortfall (operations with few distinct
            # inputs) is made up by the next pass.
            per_operation = max(len(SCOPES), math.ceil((cases - sent) / operations * 1.1))
            print(f"-- {ledger}: pass {pass_number}, {per_operation} cases per operation and mode", flush=True)
            for mode in MODES:
                for scope in SCOPES:
                    tally = fuzzer.run(scope, mode, fuzzer.split(per_operation))
                    tallies.append(tally)
                    sent += tally.cases
                    statuses = " ".join(f"{status}:{count}" for status, count in sorted(tally.statuses.items()))
                    print(f"{ledger:<20}{scope:<8}{tally.mode:<10}{tally.cases:>6} cases {tally.seconds:>6.1f} s  "
                          f"failures {len(tally.failures)}  statuses {statuses}", flush=True)
    finally:
        close_env(env)
    return tallies


def report(ledger: str, tallies: list[Tally], seconds: float, requested: int) -> bool:
    """Print each failure, record the ledger's figures; whether everything passed."""
    cases = sum(t.cases for t in tallies)
    server_errors = sum(t.server_errors for t in tallies)
    unavailable = sum(t.statuses.get(503, 0) for t in tallies)
    failing = sum(t.failing_cases for t in tallies)
    found = [found for t in tallies for found in t.failures]
    distinct = Counter((f.scope, f.mode, f.operation, f.check) for f in found)
    for failure in found:
        print(f"\n{failure.describe()}", flush=True)
    statuses: Counter[int] = Counter()
    for tally in tallies:
        statuses.update(tally.statuses)
    print(f"\n{ledger}: {cases} cases in {seconds:.0f} s; statuses "
          + " ".join(f"{status}:{count}" for status, count in sorted(statuses.items())), flush=True)
    scopes = "no token, fleet, read, submit, admin; positive and negative"
    _table.record(BENCH, f"cases executed ({ledger})", cases, "cases", at_least=TARGET_CASES,
                  vs=f"schemathesis, every check; {scopes}",
                  note="" if cases >= TARGET_CASES else f"a shorter run (--cases {requested})")
    _table.record(BENCH, f"5xx answers ({ledger})", server_errors, "answers", at_most=0,
                  note=f"documented 503s (Retry-After) not counted: {unavailable}")
    _table.record(BENCH, f"failing cases ({ledger})", failing, "cases", at_most=0,
                  note=f"{len(distinct)} distinct failure(s) (scope, mode, operation, check)")
    _table.record(BENCH, f"seconds ({ledger})", seconds, "s", note=f"{cases / seconds:.0f} cases/s, in process")
    return server_errors == 0 and failing == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=TARGET_CASES, help="requests to send per ledger (at least)")
    parser.add_argument("--ledger", nargs="+", choices=("sqlite", "postgres"), default=["sqlite"])
    parser.add_argument("--open-reads", action="store_true",
                        help="with open_reads on and public_metrics off (reads need no token, /metrics does)")
    args = parser.parse_args(argv)

    overrides = {"open_reads": True, "public_metrics": False} if args.open_reads else {}
    ok = True
    with interrupt_on_signals():
        for ledger in args.ledger:
            workdir = Path(tempfile.mkdtemp(prefix=f"compilesvc-fuzz-{ledger}-"))
            pg_url = create_pg_database("compilesvc_bench") if ledger == "postgres" else None
            try:
                started = time.monotonic()
                url = pg_url or f"sqlite:///{workdir / 'ledger.db'}"
                label = f"{ledger}, open reads" if args.open_reads else ledger
                tallies = run_ledger(label, url, workdir, args.cases, **overrides)
                ok = report(label, tallies, time.monotonic() - started, args.cases) and ok
            finally:
                if pg_url is not None:
                    drop_pg_database(pg_url)
                shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
