"""Do build history and the Stats page stay fast at scale? ``python -m bench.history_scale [--rows 1000000]``

Creates two throwaway Postgres databases (a small one, 1,000 builds by default, and one with ``--rows``
builds), migrates both with the real migrations, bulk-loads them in SQL (``INSERT … SELECT`` over
``generate_series``, with the secondary indexes rebuilt afterwards), ``VACUUM ANALYZE``s, and then times the
real :mod:`compilesvc.history` and :mod:`compilesvc.stats` calls (the stats for the day and the week
windows), each in a fresh session as the API would make them. It prints, per query, the p50, p95 and p99
latency at both sizes and their ratio (keyset pagination and window-bounded stats should keep the ratio
near 1), then ``EXPLAIN (ANALYZE, BUFFERS)`` of every statement those calls run on the large database, and
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
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.db import make_engine, make_sessionmaker
from compilesvc.history import (
    HistoryFilter,
    count_by_state,
    encode_cursor,
    get_build_detail,
    list_builds,
)
from compilesvc.migrate import upgrade
from compilesvc.stats import WINDOWS, Window, compile_times, failures, outcomes, queue_wait, window

ADMIN_URL = os.environ.get("COMPILESVC_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
MODELS = 400  # distinct models; popularity is skewed (model-0 is in ~14% of artifacts)
USERS = 300
TEAMS = 40
PAGE = 50

# ---------------------------------------------------------------------------------------------------------
# Data. Artifacts first (a build copies target/sdk/backend/model from its artifact, as submit does), then
# builds, then their labels exploded from builds.labels, then 2 bucket compiles per artifact, their failures,
# and one event per build and per artifact so the detail queries run against tables of realistic size.
# Builds come every 30 s up to the load's time (a million span 11 months), artifacts every 2 min.
#
# Distributions: targets inf2 55% / trn1 25% / cpu ~20% / trn2 ~0.05% (the rare value); SDK releases and
# the set of models in use move with time (so a filter's matches are not spread evenly over the id order,
# which is what trips a planner into walking the primary key); builds mostly use artifacts of their own
# time; states 88% succeeded, 9% failed, 3% cancelled, with "building" only among the newest 500 builds;
# 95% of builds name a submitter; every build has a team label, 60% an env label and every 50th build a
# unique ticket label (the rare label). For the statistics: hits reuse both buckets and 30% of new builds
# one; a compile is queued with its artifact, waits seconds to a minute (5%: up to an hour), compiles for
# seconds on cpu and 10 min to ~4 h on Neuron (the newest are still running), and 3% fail; 8% of compiles
# have a retried failure.
# ---------------------------------------------------------------------------------------------------------

LOAD_SQL: list[tuple[str, str]] = [
    (
        "artifacts",
        """
    CREATE TEMP TABLE bench_artifacts AS
    SELECT a AS id,
           -- Newer artifacts draw from more models (new models appear over time); model-0 stays popular.
           floor(power(random(), 3) * (20 + q * (:models - 20)))::int AS m,
           CASE WHEN a % 2000 = 1 THEN 'trn2' WHEN r1 < 0.55 THEN 'inf2' WHEN r1 < 0.80 THEN 'trn1'
                ELSE 'cpu' END AS target,
           -- SDK releases follow time, overlapping at the edges: 2.18.0 is in the oldest ~30% only.
           CASE WHEN r1 >= 0.80 THEN (CASE WHEN q < 0.6 THEN '2.12.1' ELSE '2.13.0' END)
                ELSE (ARRAY['2.18.0', '2.19.1', '2.20.2', '2.21.0'])[
                         1 + greatest(0, least(3, floor(q * 4 + (r2 - 0.5) * 0.5)::int))] END AS sdk
    FROM (SELECT a, a::float8 / :artifacts AS q, random() AS r1, random() AS r2
          FROM generate_series(1, :artifacts) AS a) s
    """,
    ),
    (
        "artifacts",
        """
    INSERT INTO artifacts (id, key, state, target, sdk, backend, model_sha256, material, components,
                           manifest_uri, size_bytes, created_at, updated_at, published_at)
    SELECT id, encode(sha256(('artifact-' || id)::bytea), 'hex'), 'published', target, sdk,
           CASE WHEN target = 'cpu' THEN 'torchscript' ELSE 'trace' END,
           encode(sha256(('model-' || m)::bytea), 'hex'),
           '{"flags": ["--auto-cast=none"], "key_version": 1}'::jsonb, '{"compiler": "neuronx-cc"}'::jsonb,
           's3://artifacts/sets/' || id || '/manifest.json', 1048576 * (1 + id % 300),
           now() - make_interval(secs => (:artifacts - id) * 120), now(), now()
    FROM bench_artifacts
    """,
    ),
    (
        "builds",
        """
    INSERT INTO builds (id, artifact_id, artifact_key, state, outcome, submitted_by, labels, spec, model_name,
                        model_sha256, target, sdk, backend, idempotency_key, request_hash, created_at,
                        finished_at, buckets_reused)
    SELECT g.id, a.id, a.key,
           CASE WHEN g.id > :n - 500 AND g.r1 < 0.6 THEN 'building' WHEN g.r1 < 0.88 THEN 'succeeded'
                WHEN g.r1 < 0.97 THEN 'failed' ELSE 'cancelled' END,
           CASE WHEN g.r2 < 0.7 THEN 'hit' WHEN g.r2 < 0.8 THEN 'join' ELSE 'new' END,
           CASE WHEN g.r3 < 0.05 THEN NULL ELSE 'user-' || floor(power(g.r3, 2) * :users)::int END,
           jsonb_strip_nulls(jsonb_build_object(
               'team', 'team-' || lpad(floor(g.r4 * :teams)::int::text, 2, '0'),
               'env', CASE WHEN g.r5 < 0.3 THEN 'prod' WHEN g.r5 < 0.5 THEN 'staging'
                           WHEN g.r5 < 0.6 THEN 'dev' END,
               'ticket', CASE WHEN g.id % 50 = 0 THEN 'T-' || g.id END)),
           jsonb_build_object(
               'model', jsonb_build_object('uri', 's3://models/model-' || ba.m || '/model.pt',
                                           'name', 'model-' || ba.m, 'format', 'torchscript'),
               'target', a.target, 'sdk', a.sdk,
               'compiler', jsonb_build_object('backend', a.backend, 'optlevel', 2),
               'buckets', '[{"inputs": [{"name": "input_ids", "shape": [1, 128], "dtype": "int64"}]},
                            {"inputs": [{"name": "input_ids", "shape": [4, 128], "dtype": "int64"}]}]'::jsonb),
           CASE WHEN g.r2 < 0.05 THEN NULL ELSE 'model-' || ba.m END,
           a.model_sha256, a.target, a.sdk, a.backend,
           CASE WHEN g.r6 < 0.5 THEN md5('idem-' || g.id) END, md5('req-' || g.id),
           now() - make_interval(secs => (:n - g.id) * 30),
           CASE WHEN g.id <= :n - 500 THEN now() - make_interval(secs => (:n - g.id) * 30 - 300) END,
           -- A hit reuses both buckets; 30% of new builds find one of the two compiled already.
           CASE WHEN g.r2 < 0.7 THEN 2 WHEN g.r2 < 0.8 THEN 0 WHEN g.r2 < 0.86 THEN 1 ELSE 0 END
    FROM (SELECT id,
                 -- 80% reuse or create an artifact of about their own time (the newest 2%, never before
                 -- artifact 1, so no artifact is favoured), 20% hit an artifact from the newer half of the
                 -- history so far (teams move on; very old sets are rarely asked for).
                 greatest(1, least(:artifacts, CASE
                     WHEN random() < 0.8 THEN ceil(id::float8 * :artifacts / :n
                         - random() * least(:artifacts * 0.02, id::float8 * :artifacts / :n - 1))
                     ELSE ceil((0.5 + 0.5 * random()) * id * :artifacts / :n) END))::bigint AS aid,
                 random() AS r1, random() AS r2, random() AS r3, random() AS r4, random() AS r5,
                 random() AS r6
          FROM generate_series(1, :n) AS id) g
    JOIN artifacts a ON a.id = g.aid
    JOIN bench_artifacts ba ON ba.id = g.aid
    ORDER BY g.id
    """,
    ),
    (
        "build_labels",
        "INSERT INTO build_labels (build_id, name, value) SELECT b.id, kv.key, kv.value "
        "FROM builds b, jsonb_each_text(b.labels) kv",
    ),
    (
        "bucket_compiles",
        """
    INSERT INTO bucket_compiles (id, key, state, target, sdk, backend, queue, model, material, inputs,
                                 attempts, max_attempts, lease_token, cancel_requested, manifest_uri,
                                 error_class, error_code, queued_at, started_at, finished_at, compile_seconds,
                                 updated_at, origin_build_id)
    SELECT b, encode(sha256(('bucket-' || b)::bytea), 'hex'),
           CASE WHEN done > now() THEN 'running' WHEN failed THEN 'failed' ELSE 'succeeded' END,
           target, sdk, backend, 'neuron-' || sdk, '{"uri": "s3://models/m.pt"}'::jsonb, '{}'::jsonb,
           '[{"shape": [1, 128], "dtype": "int64"}]'::jsonb, 1, 3, 1, false,
           CASE WHEN done <= now() AND NOT failed THEN 's3://artifacts/buckets/' || b || '.json' END,
           CASE WHEN done <= now() AND failed THEN 'compile' END,
           CASE WHEN done <= now() AND failed THEN 'NCC_EXTP004' END,
           queued, started, CASE WHEN done <= now() THEN done END,
           CASE WHEN done <= now() AND NOT failed THEN extract(epoch FROM done - started) END, now(),
           -- Queued by the build submitted at the artifact's time (builds come 4 times as often); 5% were
           -- imported from the store or queued by a build without a name, and take their artifact's.
           CASE WHEN r4 >= 0.05 THEN least(:n, 4 * aid) END
    FROM (SELECT b, a.id AS aid, a.target, a.sdk, a.backend, a.created_at AS queued,
                 a.created_at + w.wait AS started, a.created_at + w.wait + w.secs AS done, w.failed, w.r4
          FROM generate_series(1, 2 * :artifacts) AS b
          JOIN artifacts a ON a.id = (b + 1) / 2
          CROSS JOIN LATERAL (SELECT
              -- Waits: mostly under a minute or two, 5% stuck behind a busy queue for up to an hour.
              make_interval(secs => CASE WHEN random() < 0.05 THEN random() * 3600
                                         ELSE -ln(1 - random()) * 45 END) AS wait,
              -- Compiles: seconds on cpu; 10 min to ~4 h on Neuron, skewed short.
              make_interval(secs => CASE WHEN a.target = 'cpu' THEN 5 + random() * 60
                                         ELSE 600 * exp(power(random(), 2) * 3.2) END) AS secs,
              random() < 0.03 AS failed, random() AS r4) w) s
    """,
    ),
    (
        "bucket_compiles",
        "INSERT INTO artifact_buckets (artifact_id, bucket_compile_id, position) "
        "SELECT (b + 1) / 2, b, (b + 1) % 2 FROM generate_series(1, 2 * :artifacts) AS b",
    ),
    (
        "bucket_failures",
        """
    INSERT INTO bucket_failures (bucket_compile_id, attempt, attempt_round, at, phase, error_class, code, message,
                                 retry)
    -- 8% of started compiles had an attempt retried (a lost host, a timeout, an unexplained exit), and every
    -- failed compile ends with its final compile error.
    SELECT id, 1, 0, started_at + interval '30 seconds',
           (ARRAY['worker', 'compile', 'compile'])[k], (ARRAY['infra', 'timeout', 'unknown'])[k], NULL,
           'bench', true
    FROM (SELECT id, started_at, 1 + floor(random() * 3)::int AS k, random() AS r FROM bucket_compiles
          WHERE started_at IS NOT NULL) c
    WHERE r < 0.08
    UNION ALL
    SELECT id, 2, 0, finished_at, 'compile', 'compile', error_code, 'bench', false
    FROM bucket_compiles WHERE state = 'failed'
    """,
    ),
    (
        "events",
        """
    INSERT INTO events (at, entity, entity_id, from_state, to_state, detail)
    SELECT created_at, 'artifact', id, 'building', 'published', '{}'::jsonb FROM artifacts
    UNION ALL
    SELECT created_at, 'build', id, NULL, state, jsonb_build_object('outcome', outcome) FROM builds
    """,
    ),
]
LOADED_TABLES = ["artifacts", "builds", "build_labels", "bucket_compiles", "artifact_buckets", "bucket_failures",
                 "events"]


def _admin() -> Engine:
    return create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")


def create_database() -> str:
    name = f"compilesvc_histbench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = _admin()
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def drop_database(url: str) -> None:
    admin = _admin()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    admin.dispose()


def load(url: str, n: int) -> dict[str, float]:
    """Fill a migrated database with ``n`` builds; returns the seconds each step took."""
    steps: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[step] = steps.get(step, 0.0) + now - clock
        clock = now

    params = {"n": n, "artifacts": max(n // 4, 10), "models": MODELS, "users": USERS, "teams": TEAMS}
    engine = make_engine(url)
    with engine.begin() as conn:
        # Bench-only shortcuts, all scoped to this transaction: no WAL flush wait, skip the per-row FK
        # triggers (the data is consistent by construction), and memory for sorts, hashes and index builds.
        conn.execute(text("SET LOCAL synchronous_commit = off"))
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text("SET LOCAL maintenance_work_mem = '1GB'"))
        conn.execute(text("SET LOCAL work_mem = '256MB'"))  # in-memory hash joins and sort of the load
        conn.execute(text("SELECT setseed(0.20261121)"))
        # Maintaining a dozen btrees row by row (some on random keys: sha256s, idempotency keys) is most of
        # the cost of a bulk insert; building them once afterwards by sorting is several times faster. So
        # drop the secondary indexes and unique constraints and recreate them from their own definitions
        # (the schema ends up exactly as migrated). Primary keys stay: foreign keys depend on them, and
        # ids are inserted in order.
        indexes = conn.execute(
            text(
                "SELECT i.indexname, i.indexdef FROM pg_indexes i WHERE i.schemaname = 'public' "
                "AND i.tablename = ANY(:tables) AND NOT EXISTS (SELECT 1 FROM pg_constraint c "
                "WHERE c.conname = i.indexname)"
            ),
            {"tables": LOADED_TABLES},
        ).all()
        uniques = conn.execute(
            text(
                "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
                "WHERE c.contype = 'u' AND c.conrelid::regclass::text = ANY(:tables)"
            ),
            {"tables": LOADED_TABLES},
        ).all()
        for name, _ in indexes:
            conn.execute(text(f'DROP INDEX "{name}"'))
        for table, name, _ in uniques:
            conn.execute(text(f'ALTER TABLE "{table}" DROP CONSTRAINT "{name}"'))
        lap("setup")
        for step, statement in LOAD_SQL:
            conn.execute(text(statement), params)
            lap(step)
        for _, definition in indexes:
            conn.execute(text(definition))
        for table, name, definition in uniques:
            conn.execute(text(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}'))
        for table in ("artifacts", "builds", "bucket_compiles", "bucket_failures", "events"):
            # Ids were given explicitly; move the sequences past them so later inserts work.
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"))
        lap("indexes")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # ANALYZE for the planner; VACUUM sets the visibility map so index-only scans skip the heap.
        conn.execute(text("VACUUM (ANALYZE)"))
    lap("vacuum analyze")
    engine.dispose()
    return steps


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

    def rank(p: float) -> float:  # nearest rank, as compilesvc.stats computes its percentiles
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
    transaction-local settings the call made before them, such as compilesvc.stats turning JIT off)."""
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
        what = "plans" if args.full_plans else "plan summaries (scan and join nodes, actual rows)"
        print(f"\n{what} at {large:,} builds: EXPLAIN (ANALYZE, BUFFERS) of every statement each call runs")
        bad = []
        for name, lines, seq_scan in plans:
            print(f"=== {name}{'   <-- SEQ SCAN' if seq_scan else ''}")
            print("\n".join("    " + line for line in lines).rstrip())
            if seq_scan:
                bad.append(name)
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
