"""Do build history and the Stats page stay fast at scale? ``python -m bench.history_scale [--rows 1000000]``

Creates two throwaway Postgres databases (a small one, 1,000 builds by default, and one with ``--rows``
builds), migrates both with the real migrations, bulk-loads them in SQL (``INSERT … SELECT`` over
``generate_series``, with the secondary indexes rebuilt afterwards), ``VACUUM ANALYZE``s, and then times the
real :mod:`compilesvc.insights.history` and :mod:`compilesvc.insights.stats` calls (the stats for the day and the week
windows), each in a fresh session as the API would make them. It prints, per query, the p50, p95 and p99
latency at both sizes and their ratio (keyset pagination and window-bounded stats should keep the ratio
near 1), then ``EXPLAIN (ANALYZE, BUFFERS)`` of every statement those calls run on the large database, and
records every query's p99 at the large size in the one table (:mod:`bench._table`) against its target
(:data:`HISTORY_P99_MS` for a history call, :data:`STATS_P99_MS` for one of the Stats page's reads), and
fails (exit 1) if any plan reads a table that grows with the builds (:data:`SCANNED_TABLES`) with a
sequential scan. Both databases are dropped at the end, also on failure (unless ``--keep``).

Postgres is found at ``COMPILESVC_BENCH_PG`` (an admin URL; default the local test server).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from bench._history_data import create_database, drop_database, load
from bench._table import record
from compilesvc.insights.history import (
    HistoryFilter,
    count_by_state,
    encode_cursor,
    get_build_detail,
    list_builds,
)
from compilesvc.insights.stats import WINDOWS, Window, compile_times, failures, outcomes, queue_wait, window
from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.ledger.migrate import upgrade

PAGE = 50

# Targets for a call's p99 at 1,000,000 builds, client side (fresh session, query, ORM objects). Chosen
# here, as no doc sets a number: a history page is paged through interactively, so a call stays well under the
# ~100 ms a click feels instant within, beside rendering; the Stats page runs its four reads per window at
# once, and a read past 100 ms was the cost limit compilesvc.insights.stats' docstring records as fixed.
HISTORY_P99_MS = 50.0
STATS_P99_MS = 100.0

# ---------------------------------------------------------------------------------------------------------
# Queries
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Query:
    name: str
    run: Callable[[Session], Any]
    check: Callable[[Any], bool] = lambda _result: True


def cursor_of_page(sessions: sessionmaker[Session], page: int, filters: HistoryFilter | None = None) -> str | None:
    """The cursor that opens page ``page`` (1-based), found by walking the pages as a client would; that
    of the last page if there are fewer (None: there is only one)."""
    cursor: str | None = None
    for _ in range(page - 1):
        with sessions() as session:
            result = list_builds(session, filters, limit=PAGE, cursor=cursor)
        if result.next_cursor is None:
            break
        cursor = result.next_cursor
    return cursor


def suite(sessions: sessionmaker[Session], n: int) -> list[Query]:
    def listing(name: str, filters: HistoryFilter | None = None, cursor: str | None = None, full: bool = True) -> Query:
        def run(session: Session) -> Any:
            return list_builds(session, filters, limit=PAGE, cursor=cursor)

        # Make sure real work is timed: a full page where the data guarantees one (at 1k rows a filter
        # may match fewer than a page), at least a match otherwise, unless the case is about no matches.
        wanted = PAGE if full and n >= 100_000 else 1 if full else 0
        return Query(name, run, lambda page: len(page.items) >= wanted)

    rare_ticket = f"ticket:T-{(n // 2) // 50 * 50}"
    model_sha = _model_sha(sessions, "model-7")
    detail_id = n // 2
    return [
        listing("first page, no filter"),
        listing("page 100 via cursor (or last)", cursor=cursor_of_page(sessions, 100)),
        listing("deepest page (cursor at id 51)", cursor=encode_cursor(PAGE + 1)),
        listing("target=trn1 (25%)", HistoryFilter(target="trn1")),
        listing("sdk=2.19.1 (~20%)", HistoryFilter(sdk="2.19.1")),
        listing("state=failed (9%)", HistoryFilter(state="failed")),
        listing("state=building (newest 300)", HistoryFilter(state="building")),
        listing("model=model-0 by name (~18%)", HistoryFilter(model="model-0")),
        listing("model=<sha256 of model-7>", HistoryFilter(model=model_sha)),
        listing("submitted_by=user-42", HistoryFilter(submitted_by="user-42")),
        listing("label team:team-07 (2.5%)", HistoryFilter(label="team:team-07")),
        listing(
            "label team:team-07, page 100 (or last)",
            HistoryFilter(label="team:team-07"),
            cursor=cursor_of_page(sessions, 100, HistoryFilter(label="team:team-07")),
            full=False,
        ),
        listing(f"rare label {rare_ticket}", HistoryFilter(label=rare_ticket), full=False),
        listing("rare target=trn2 (0.05%)", HistoryFilter(target="trn2"), full=False),
        listing("no match submitted_by=nobody", HistoryFilter(submitted_by="nobody"), full=False),
        listing("sdk=2.18.0 (none in the newest ~40%)", HistoryFilter(sdk="2.18.0")),
        listing("target=inf2 & state=failed", HistoryFilter(target="inf2", state="failed")),
        listing("target=inf2 & sdk=2.18.0 (composite idx)", HistoryFilter(target="inf2", sdk="2.18.0")),
        listing("state=cancelled & sdk=2.18.0 (old)", HistoryFilter(state="cancelled", sdk="2.18.0")),
        listing(
            "target=inf2 & state=failed & env:prod", HistoryFilter(target="inf2", state="failed", label="env:prod")
        ),
        listing(
            "model=model-0 & target=trn1 & team-07",
            HistoryFilter(model="model-0", target="trn1", label="team:team-07"),
            full=False,
        ),
        Query("count_by_state(cap=1000)", lambda s: count_by_state(s, cap=1000)),
        *stats_queries(n),
        Query(
            f"get_build_detail({detail_id})",
            lambda s: get_build_detail(s, detail_id),
            lambda d: d is not None and len(d.buckets) == 2 and len(d.events) == 2,
        ),
    ]


def stats_queries(n: int) -> list[Query]:
    """The Stats page's queries for each window, each timed on its own (the page runs all four). The window
    is taken at each call, as the page does; the data's newest rows are at load time, so it is busy."""

    def query(label: str, name: str, read: Callable[[Session, Window], Any], check: Callable[[Any], bool]) -> Query:
        return Query(f"stats {name}: {label}", lambda session: read(session, window(name)), check)

    queries = []
    for name in WINDOWS:
        queries += [
            query("outcomes per bin", name, outcomes, lambda bins: sum(b.total for b in bins) > 0),
            query("compile p50/p95 by model+target", name, compile_times, lambda found: len(found) > 0),
            query("failures by class", name, failures, lambda found: n < 100_000 or len(found) > 0),
            query("queue wait p50/p95", name, queue_wait, lambda found: found.overall.count > 0),
        ]
    return queries


def _model_sha(sessions: sessionmaker[Session], name: str) -> str:
    with sessions() as session:
        return str(session.scalar(text("SELECT encode(sha256(CAST(:n AS bytea)), 'hex')"), {"n": name}))


@dataclass
class Timing:
    median_ms: float  # client side: a fresh session, the query, building the ORM objects
    p95_ms: float
    p99_ms: float
    db_ms: float  # server side: planning + execution of the same statements (median), without the client


def time_query(engine: Engine, sessions: sessionmaker[Session], query: Query, reps: int) -> Timing:
    for _ in range(5):  # warm the pool, the caches and SQLAlchemy's statement cache
        with sessions() as session:
            result = query.run(session)
    if not query.check(result):
        raise SystemExit(f"{query.name}: unexpected result {result!r}")
    samples = []
    for _ in range(reps):
        started = time.perf_counter_ns()
        with sessions() as session:  # a fresh session per call, as in a request
            query.run(session)
        samples.append((time.perf_counter_ns() - started) / 1e6)
    samples.sort()

    def rank(p: float) -> float:  # nearest rank, as compilesvc.insights.stats computes its percentiles
        return samples[max(0, math.ceil(p * len(samples)) - 1)]

    return Timing(statistics.median(samples), rank(0.95), rank(0.99),
                  db_time(engine, sessions, query, max(reps // 4, 5)))


def db_time(engine: Engine, sessions: sessionmaker[Session], query: Query, reps: int) -> float:
    """Median server time of the statements a call runs, from EXPLAIN ANALYZE (TIMING OFF keeps the
    instrumentation overhead low). Separates the database's share from Python, the ORM and the network, and
    from CPU contention on a shared machine."""
    with recorded_statements(engine) as statements, sessions() as session:
        query.run(session)
    samples = []
    with engine.connect() as conn:
        for _ in range(reps):
            total = 0.0
            for statement, parameters in statements:
                if _is_setting(statement):
                    conn.exec_driver_sql(statement, parameters)
                    continue
                plan = conn.exec_driver_sql(
                    "EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON, FORMAT JSON) " + statement, parameters
                ).scalar_one()
                total += plan[0]["Planning Time"] + plan[0]["Execution Time"]
            samples.append(total)
    return statistics.median(samples)


def _is_setting(statement: str) -> bool:
    return statement.lstrip().upper().startswith("SET ")


@contextmanager
def recorded_statements(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """Captures the SQL and parameters the ORM sends, to EXPLAIN exactly those statements (with the
    transaction-local settings the call made before them, such as compilesvc.insights.stats turning JIT off)."""
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") or _is_setting(statement):
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


# Tables that grow with the builds: no plan may read one of them whole.
SCANNED_TABLES = ("builds", "build_labels", "bucket_compiles", "artifact_buckets", "bucket_failures")

# Plan lines worth keeping in the summary: the access paths and how they are joined.
_NODE_RE = re.compile(r"(Scan|Join|Nested Loop|Append|Gather)")
_DETAIL_PREFIXES = ("Index Cond", "Recheck Cond", "Filter", "Merge Cond", "Join Filter", "Hash Cond", "Heap Fetches")


def explain(engine: Engine, sessions: sessionmaker[Session], query: Query, full: bool) -> tuple[list[str], bool]:
    """The plans of every statement the query runs (a summary of the scan and join nodes with their
    actual row counts, or the full plans), and whether any plan scans one of :data:`SCANNED_TABLES`
    sequentially."""
    with recorded_statements(engine) as statements, sessions() as session:
        query.run(session)
    lines: list[str] = []
    seq_scan = False
    with engine.connect() as conn:
        queries = [(statement, parameters) for statement, parameters in statements if not _is_setting(statement)]
        for statement, parameters in statements:
            if _is_setting(statement):
                conn.exec_driver_sql(statement, parameters)
        for number, (statement, parameters) in enumerate(queries, 1):
            plan = (
                conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, parameters).scalars().all()
            )
            seq_scan = seq_scan or any(f"Seq Scan on {table} " in ln for ln in plan for table in SCANNED_TABLES)
            if full:
                lines.extend([*plan, ""])
                continue
            total = next((ln.split(":", 1)[1].strip() for ln in plan if ln.startswith("Execution Time")), "?")
            # The first Buffers line belongs to the top node: pages touched by the whole statement.
            pages = next((ln.split("hit=", 1)[1].split()[0] for ln in plan if "Buffers: shared hit=" in ln), "?")
            prefix = f"statement {number}: " if len(queries) > 1 else ""
            lines.append(f"{prefix}execution {total}, {pages} buffer pages")
            for line in plan:
                node = line.strip().removeprefix("->").strip()
                if not _NODE_RE.search(node) or node.startswith(_DETAIL_PREFIXES):
                    continue
                node = re.sub(r"\(actual time=\S+ ", "(", node)  # keep rows/loops, drop timings
                indent = (len(line) - len(line.lstrip())) // 3
                lines.append("  " + " " * indent + node)
    return lines, seq_scan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.history_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="builds in the large database")
    parser.add_argument("--small", type=int, default=1_000, help="builds in the small database")
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions per query")
    parser.add_argument("--keep", action="store_true", help="leave the databases for inspection")
    parser.add_argument("--full-plans", action="store_true", help="print whole plans, not summaries")
    args = parser.parse_args(argv)

    urls: dict[int, str] = {}
    try:
        timings: dict[int, list[tuple[str, Timing]]] = {}
        plans: list[tuple[str, list[str], bool]] = []
        for n in (args.small, args.rows):
            urls[n] = url = create_database()
            upgrade(url)
            steps = load(url, n)
            engine = make_engine(url)
            sessions = make_sessionmaker(engine)
            with engine.connect() as conn:
                size = conn.scalar(text("SELECT pg_size_pretty(pg_total_relation_size('builds'))"))
                labels = conn.scalar(text("SELECT count(*) FROM build_labels"))
            detail = ", ".join(f"{step} {seconds:.1f}" for step, seconds in steps.items())
            print(
                f"loaded {n:,} builds ({labels:,} labels, builds table+indexes {size}) in "
                f"{sum(steps.values()):.1f} s ({detail})",
                flush=True,
            )
            queries = suite(sessions, n)
            timings[n] = [(q.name, time_query(engine, sessions, q, args.reps)) for q in queries]
            if n == args.rows:
                plans = [(q.name, *explain(engine, sessions, q, args.full_plans)) for q in queries]
            engine.dispose()

        small, large = args.small, args.rows
        loadavg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"\nlatency per call in ms: client = fresh session + query + ORM objects ({args.reps} reps, "
            f"p50, p95 and p99); db = server planning + execution (median). Load average now: {loadavg}"
        )
        header = (
            f"{'query':<44} {f'{small:,} p50':>10} {'p95':>6} {'p99':>6} {'db':>5} {f'{large:,} p50':>14} "
            f"{'p95':>6} {'p99':>6} {'db':>5} {'ratio':>6} {'db ratio':>8}"
        )
        print(header)
        print("-" * len(header))
        for (name, ts), (_, tl) in zip(timings[small], timings[large], strict=True):
            print(
                f"{name:<44} {ts.median_ms:>10.2f} {ts.p95_ms:>6.2f} {ts.p99_ms:>6.2f} {ts.db_ms:>5.2f} "
                f"{tl.median_ms:>14.2f} {tl.p95_ms:>6.2f} {tl.p99_ms:>6.2f} {tl.db_ms:>5.2f} "
                f"{tl.median_ms / ts.median_ms:>6.2f} {tl.db_ms / ts.db_ms:>8.2f}"
            )
        for (name, ts), (_, tl) in zip(timings[small], timings[large], strict=True):
            record("history_scale", f"p99 at {large:,} builds: {name}", tl.p99_ms, "ms",
                   at_most=STATS_P99_MS if name.startswith("stats ") else HISTORY_P99_MS,
                   vs=f"{small:,} builds: p99 {ts.p99_ms:.2f} ms",
                   note=f"p50 {tl.median_ms:.2f} ms ({tl.median_ms / ts.median_ms:.2f}x {small:,}), "
                        f"db {tl.db_ms:.2f} ms")
        what = "plans" if args.full_plans else "plan summaries (scan and join nodes, actual rows)"
        print(f"\n{what} at {large:,} builds: EXPLAIN (ANALYZE, BUFFERS) of every statement each call runs")
        bad = []
        for name, lines, seq_scan in plans:
            print(f"=== {name}{'   <-- SEQ SCAN' if seq_scan else ''}")
            print("\n".join("    " + line for line in lines).rstrip())
            if seq_scan:
                bad.append(name)
        record("history_scale", f"plans with a sequential scan of a growing table, {large:,} builds", len(bad), "",
               at_most=0, vs=f"{len(plans)} calls' plans", note=", ".join(bad))
        if bad:
            print(f"\nFAIL: sequential scan of {'/'.join(SCANNED_TABLES)} in: {', '.join(bad)}")
            return 1
        print(f"\nOK: no sequential scan of {', '.join(SCANNED_TABLES)} in any plan")
        return 0
    finally:
        for url in urls.values():
            if args.keep:
                print(f"kept {url}")
            else:
                drop_database(url)


if __name__ == "__main__":
    sys.exit(main())
