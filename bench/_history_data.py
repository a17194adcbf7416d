"""The history-scale benchmark's data (``python -m bench.history_scale``): throwaway Postgres databases and
a bulk load of ``n`` builds with their artifacts, labels, bucket compiles, failures and events, in SQL.

Postgres is found at ``COMPILESVC_BENCH_PG`` (an admin URL; default the local test server).
"""

from __future__ import annotations

import os
import time
import uuid

from sqlalchemy import Engine, create_engine, text

from compilesvc.ledger.engine import make_engine

ADMIN_URL = os.environ.get("COMPILESVC_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
MODELS = 400  # distinct models; popularity is skewed (model-0 is in ~14% of artifacts)
USERS = 300
TEAMS = 40

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
                        finished_at, buckets_reused, buckets_compiled)
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
           CASE WHEN g.r2 < 0.7 THEN 2 WHEN g.r2 < 0.8 THEN 0 WHEN g.r2 < 0.86 THEN 1 ELSE 0 END,
           CASE WHEN g.r2 < 0.8 THEN 0 WHEN g.r2 < 0.86 THEN 1 ELSE 2 END
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
        # As submit records it: the model name of the build that queued the compile.
        "UPDATE bucket_compiles c SET model_name = b.model_name FROM builds b WHERE b.id = c.origin_build_id",
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
