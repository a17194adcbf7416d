"""The soak (issue 12): ten minutes of a day's mixed traffic through nginx on 2 API processes and 2 workers.

Run from the repository root: ``python -m bench.soak [--seconds 600] [--clients 6] [--every 60] [--keep]``.

The stack and the load are the soak test's (``tests/soak``: README there): ``compilesvc serve`` (gunicorn, 2
processes), a relay and 2 ``compilesvc worker`` processes on a fresh Postgres database, Redis under a key
prefix of its own and a ``weed mini`` S3 store, behind a real nginx running compose's configuration; the
clients look artifacts up, download and check them, resubmit (hits), join builds in flight, submit new
shapes (the Neuron double compiles them), poll builds, read logs and browse the UI pages. The test runs it
for a minute; here it runs long enough for a leak to show. Every process's RSS and open fds are sampled
after the warm-up, every ``--every`` seconds and at the end; the series is printed per process, and the growth
from the first sample to the last goes into the table (:mod:`bench._table`) per process kind (the largest
of its processes).

Exit status 1 when a request failed, the service logged an error, or a build was lost.
"""

from __future__ import annotations

import argparse
import sys

from bench._cluster import interrupt_on_signals
from bench._table import record
from tests.soak.procs import Growth, kind, table
from tests.soak.run import SoakResult, soak
from tests.soak.stack import soak_stack

BENCH = "soak"
#: The request kinds whose latency goes into the table (every kind's is printed).
LATENCY_KINDS = ("lookup", "hit", "download", "poll", "ui", "new", "join")


def series_table(result: SoakResult) -> str:
    """RSS (MiB) / open fds of each process at each sample of the load."""
    names = [g.name for g in result.growth]
    lines = ["second  " + "  ".join(f"{name:>18}" for name in names)]
    for at, found in result.series:
        cells = [f"{found[n].rss_kib / 1024:>9.1f}M/{found[n].fds:<5}" if n in found else f"{'-':>16}" for n in names]
        lines.append(f"{at:>6.0f}  " + "  ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def by_kind(rows: list[Growth]) -> dict[str, list[Growth]]:
    kinds: dict[str, list[Growth]] = {}
    for row in rows:
        kinds.setdefault(kind(row.name), []).append(row)
    return kinds


def report(result: SoakResult) -> None:
    t, d = result.tally, result.drained
    window = result.seconds - result.warmup
    setup = f"{result.clients} clients, {result.seconds:.0f} s"
    record(BENCH, "requests", t.total, "requests", vs=setup)
    record(BENCH, "request rate", t.total / result.seconds, "req/s", vs=setup,
           note="2 API processes behind nginx; the clients share the host")
    record(BENCH, "errors", result.errors, "errors", at_most=0,
           note=f"{t.error_count} failed requests, {len(result.logged_errors)} ERROR records logged")
    record(BENCH, "recoveries by the reaper", len(result.recoveries), "events", at_most=0,
           note="leases expired, compiles requeued/failed/cancelled, messages resent")
    record(BENCH, "warnings logged", result.logged_warnings.total(), "records",
           note="; ".join(f"{n} x {text}" for text, n in result.logged_warnings.most_common(4)))
    record(BENCH, "submit 503s retried", t.retried_503, "submits", note="503 + Retry-After, waited out")
    record(BENCH, "builds accepted", d.accepted, "builds",
           note=", ".join(f"{k} {n}" for k, n in sorted(t.outcomes.items())))
    record(BENCH, "builds lost", result.lost, "builds", at_most=0,
           note=f"{d.terminal} of {d.accepted} terminal after the drain, {len(d.unpublished)} succeeded unpublished")
    record(BENCH, "builds not succeeded", d.accepted - d.states.get("succeeded", 0), "builds", at_most=0,
           note="every compile of the double succeeds")
    record(BENCH, "compile processes left", sum(result.children_after.values()), "processes", at_most=0,
           note="under the workers once every build is terminal")
    for name in LATENCY_KINDS:
        if t.requests.get(name):
            record(BENCH, f"p99 latency: {name}", t.percentile(name, 0.99) * 1000, "ms",
                   note=f"p50 {t.percentile(name, 0.5) * 1000:.0f} ms, {t.requests[name]} requests")
    for name, rows in by_kind(result.growth).items():
        same = [r for r in rows if r.same_process]
        if len(same) != len(rows):
            record(BENCH, f"{name}: gone or replaced during the load", sum(r.end is None for r in rows), "processes",
                   at_most=0)
        if not same:
            continue
        rss = max(same, key=lambda r: r.rss_kib)
        fds = max(same, key=lambda r: r.fds)
        of = f" (largest of {len(same)})" if len(same) > 1 else ""
        assert rss.start is not None and fds.start is not None
        record(BENCH, f"RSS growth: {name}{of}", rss.rss_kib / 1024, "MiB", vs=f"{rss.start.rss_kib / 1024:.0f} MiB "
               f"after the warm-up", note=f"over {window:.0f} s")
        record(BENCH, f"fd growth: {name}{of}", fds.fds, "fds", vs=f"{fds.start.fds} fds after the warm-up",
               note=f"over {window:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="length of the load")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (threads)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds into the load of the first process sample (default: a quarter, <= 60)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between process samples")
    parser.add_argument("--drain-seconds", type=float, default=120.0,
                        help="how long every accepted build has to be terminal once the load stops")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (every process's log)")
    args = parser.parse_args(argv)

    with interrupt_on_signals(), soak_stack(keep=args.keep) as stack:
        print(f"soak: {args.seconds:.0f} s, {args.clients} clients through nginx at {stack.base}", flush=True)
        result = soak(stack, args.seconds, clients=args.clients, warmup=args.warmup, every=args.every,
                      drain_timeout=args.drain_seconds)
    print(result.summary())
    print(f"\nRSS / open fds per process, by second of the load (from the warm-up at {result.warmup:.0f} s):")
    print(series_table(result))
    print(f"\ngrowth from {result.warmup:.0f} s to the end:")
    print(table(result.growth))
    print()
    report(result)
    return 1 if result.errors or result.lost else 0


if __name__ == "__main__":
    sys.exit(main())
