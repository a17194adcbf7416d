"""Alembic migrations on fresh, empty Postgres and SQLite databases: upgrade/downgrade round trips, every
revision reversible on its own, and no drift between the migrated schema and the ORM models."""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import JSON, insert, pool, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import IntegrityError

from compilesvc.ledger.engine import make_engine
from compilesvc.ledger.migrate import alembic_config, downgrade, upgrade
from compilesvc.ledger.models import Base
from compilesvc.states import ArtifactState, BucketState, BuildState, ErrorClass, Outcome
from tests.fixtures.ledger import create_pg_database, drop_pg_database

VERSION_TABLE = "alembic_version"


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A brand-new database with nothing in it (not the shared, already migrated test ledger)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    url = create_pg_database("compilesvc_migr")
    try:
        yield url
    finally:
        drop_pg_database(url)


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def _revisions_base_to_head() -> list[Script]:
    return list(reversed(list(_script().walk_revisions())))


def _schema(url: str) -> dict[str, Any]:
    """Everything the migrations own, in a comparable form: tables, columns, keys, indexes (and on
    Postgres, any other relation such as a sequence, so a downgrade that leaks one is caught)."""
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            insp = sa_inspect(conn)
            tables: dict[str, Any] = {}
            for name in sorted(insp.get_table_names()):
                tables[name] = {
                    "columns": [(c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(name)],
                    "pk": insp.get_pk_constraint(name)["constrained_columns"],
                    "fks": sorted(
                        (fk["name"] or "", tuple(fk["constrained_columns"]), fk["referred_table"])
                        for fk in insp.get_foreign_keys(name)
                    ),
                    "indexes": sorted(
                        (ix["name"] or "", tuple(str(c) for c in ix["column_names"]), bool(ix["unique"]))
                        for ix in insp.get_indexes(name)
                    ),
                    "uniques": sorted(
                        (uq["name"] or "", tuple(uq["column_names"])) for uq in insp.get_unique_constraints(name)
                    ),
                    "checks": sorted(
                        (ck["name"] or "", " ".join(ck["sqltext"].replace("(", " ").replace(")", " ").split()))
                        for ck in insp.get_check_constraints(name)
                    ),
                }
            relations: list[str] = []
            if conn.dialect.name == "postgresql":
                relations = list(
                    conn.scalars(
                        text(
                            "SELECT c.relkind::text || ':' || c.relname FROM pg_class c "
                            "JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE n.nspname = 'public' ORDER BY 1"
                        )
                    )
                )
            return {"tables": tables, "relations": relations}
    finally:
        engine.dispose()


def _current_revision(url: str) -> str | None:
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def test_single_head() -> None:
    # Two engineers adding revisions on the same parent gives two heads, and "upgrade head" then fails.
    assert len(_script().get_heads()) == 1, f"multiple heads: {_script().get_heads()}; add a merge revision"


def test_every_revision_has_a_real_downgrade() -> None:
    for script in _revisions_base_to_head():
        downgrade_fn = getattr(script.module, "downgrade", None)
        assert callable(downgrade_fn), f"{script.revision} has no downgrade()"
        body = ast.parse(inspect.getsource(downgrade_fn)).body[0]
        assert isinstance(body, ast.FunctionDef)
        statements = [
            s
            for s in body.body
            if not isinstance(s, ast.Pass)
            and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))  # docstring / ...
        ]
        assert statements, f"revision {script.revision}: downgrade() does nothing"


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    head = _script().get_current_head()
    upgrade(empty_url)
    migrated = _schema(empty_url)
    assert set(migrated["tables"]) == {t.name for t in Base.metadata.sorted_tables} | {VERSION_TABLE}
    assert _current_revision(empty_url) == head

    downgrade(empty_url, "base")
    emptied = _schema(empty_url)
    # Alembic keeps its (now empty) version table; everything else must be gone, indexes and sequences too.
    assert set(emptied["tables"]) == {VERSION_TABLE}
    if emptied["relations"]:
        assert emptied["relations"] == ["i:alembic_version_pkc", "r:alembic_version"]
    assert _current_revision(empty_url) is None

    upgrade(empty_url)
    assert _current_revision(empty_url) == head
    assert _schema(empty_url) == migrated


@pytest.mark.slow
def test_each_revision_downgrades_to_its_parent_schema(empty_url: str) -> None:
    """The stairway: for every revision, upgrade, downgrade one step, and get exactly the schema of the
    parent back; then upgrade again (so a downgrade that leaves debris breaks the re-upgrade)."""
    before = _schema(empty_url)
    for script in _revisions_base_to_head():
        parent = script.down_revision
        assert parent is None or isinstance(parent, str), "merge revisions: extend this test"
        upgrade(empty_url, script.revision)
        after = _schema(empty_url)
        downgrade(empty_url, parent or "base")
        assert _schema(empty_url)["tables"] == before["tables"] | (
            {VERSION_TABLE: after["tables"][VERSION_TABLE]} if parent is None else {}
        ), f"downgrade of {script.revision} does not restore the schema of {parent or 'base'}"
        upgrade(empty_url, script.revision)
        assert _schema(empty_url) == after
        before = after


def test_models_match_migrations(empty_url: str) -> None:
    """What autogenerate would write for the models against a migrated database: nothing. Types and
    server defaults are compared too, with no exceptions needed on either backend."""
    upgrade(empty_url)
    engine = make_engine(empty_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; add a revision (alembic revision --autogenerate): {diff}"


def _valid_row(table: str, **values: Any) -> dict[str, Any]:
    """Values for every NOT NULL column of ``table`` (ids of rows it references must be passed)."""
    row: dict[str, Any] = {}
    for column in Base.metadata.tables[table].columns:
        if column.nullable or column.primary_key:
            continue
        if isinstance(column.type, JSON):
            row[column.name] = {}
            continue
        python_type = column.type.python_type
        row[column.name] = {str: "x", int: 1, bool: False, float: 1.0}.get(python_type, datetime.now(UTC))
    row.update(values)
    return row


@pytest.mark.parametrize(("table", "column"), [("bucket_compiles", "state"), ("artifacts", "state"),
                                                ("builds", "state"), ("builds", "outcome"),
                                                ("bucket_compiles", "error_class")])
def test_migrated_checks_list_exactly_the_states_of_the_state_machine(empty_url: str, table: str,
                                                                      column: str) -> None:
    """The migrated CHECK names every enum value and nothing else, and the database itself refuses a value
    outside it, whoever writes it."""
    enum = {("bucket_compiles", "state"): BucketState, ("artifacts", "state"): ArtifactState,
            ("builds", "state"): BuildState, ("builds", "outcome"): Outcome,
            ("bucket_compiles", "error_class"): ErrorClass}[(table, column)]
    upgrade(empty_url)
    engine = make_engine(empty_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            [check] = [ck for ck in sa_inspect(conn).get_check_constraints(table) if ck["name"].endswith(column)]
        assert set(re.findall(r"'([a-z_]+)'", check["sqltext"])) == {s.value for s in enum}
        tables = Base.metadata.tables
        with engine.connect() as conn, conn.begin():
            refs = {}
            if table == "builds":
                refs["artifact_id"] = conn.execute(insert(tables["artifacts"]).values(
                    _valid_row("artifacts", state="building"))).inserted_primary_key[0]
            valid = {"state": "building" if table != "bucket_compiles" else "queued", "outcome": "new"}
            row = _valid_row(table, **{k: v for k, v in valid.items() if k in tables[table].columns}, **refs)
            conn.execute(insert(tables[table]).values(row))  # a valid row is accepted ...
        with engine.connect() as conn, conn.begin(), pytest.raises(IntegrityError, match=r"(?i)check"):
            conn.execute(insert(tables[table]).values({**row, column: "bogus", **(
                {"key": "y"} if "key" in tables[table].columns else {})}))  # ... the same with a bogus value not
    finally:
        engine.dispose()


def _row_counts(url: str) -> dict[str, int]:
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return {name: int(conn.execute(text(f'SELECT count(*) FROM "{name}"')).scalar_one())
                    for name in sa_inspect(conn).get_table_names() if name != VERSION_TABLE}
    finally:
        engine.dispose()


def test_a_populated_ledger_keeps_every_row_through_each_migration(empty_url: str, tmp_path: Path) -> None:
    """Migrations that rebuild SQLite tables (batch mode) must not cascade-delete or trip foreign keys; a
    downgrade that narrows a CHECK maps the newer values onto older ones instead of failing."""
    from compilesvc.compiles import leases
    from compilesvc.ledger.engine import transaction
    from compilesvc.services import Services
    from tests.compiles.test_leases import make_settings, submit

    upgrade(empty_url)
    services = Services.from_settings(make_settings(tmp_path, empty_url))
    try:
        result = submit(services, buckets=3)
        submit(services, buckets=3)  # a second build of the same artifact
        failures = [(0, "infra", "EXIT_1"), (1, "unknown", "NEURONX_CC_EXIT_70"),
                    (2, "bad_request", "COMPILER_FLAG_REJECTED")]
        for index, error_class, code in failures:
            with transaction(services.sessions) as session:
                bucket_id = session.execute(text("SELECT id FROM bucket_compiles WHERE key = :k"),
                                            {"k": result.buckets[index].key}).scalar_one()
                claim = leases.claim(session, bucket_id, "w", 60)
                assert claim is not None
            with transaction(services.sessions) as session:
                leases.fail(session, bucket_id, claim.token, error_class, code, "boom", unknown_retries=0)
    finally:
        services.close()
    before = _row_counts(empty_url)
    assert before["builds"] == 2 and before["artifact_buckets"] == 3 and before["bucket_failures"] == 3

    revisions = _revisions_base_to_head()
    bucket_failures_added = next(r.revision for r in revisions if r.revision.startswith("0004"))
    for script in reversed(revisions[revisions.index(next(r for r in revisions
                                                          if r.revision == bucket_failures_added)):]):
        downgrade(empty_url, script.down_revision)  # one step at a time: each keeps every row it can hold
        counts = _row_counts(empty_url)
        assert counts == {k: v for k, v in before.items() if k in counts}
        if script.down_revision == bucket_failures_added:
            engine = make_engine(empty_url, poolclass=pool.NullPool)
            try:
                with engine.connect() as conn:
                    classes = {*conn.execute(text("SELECT error_class FROM bucket_failures")).scalars(),
                               *conn.execute(text("SELECT error_class FROM bucket_compiles "
                                                  "WHERE error_class IS NOT NULL")).scalars()}
            finally:
                engine.dispose()
            assert classes == {"infra", "compile"}  # unknown -> infra, bad_request -> compile
    assert "bucket_failures" not in _row_counts(empty_url)
    upgrade(empty_url)
    assert _row_counts(empty_url) == {**before, "bucket_failures": 0}


def test_the_toolchain_queue_migration_moves_stored_queues_and_unsent_messages(empty_url: str,
                                                                               tmp_path: Path) -> None:
    """0006: a Neuron compile's stored queue and its unsent dispatch message follow the toolchain naming
    (and go back on downgrade), so a retry or a relay after the upgrade reaches the new workers."""
    from compilesvc.dispatch.routing import queue_name
    from compilesvc.services import Services
    from tests.compiles.test_leases import make_settings, submit

    upgrade(empty_url)
    services = Services.from_settings(make_settings(tmp_path, empty_url))
    try:
        submit(services, buckets=2)  # inf2, SDK 2.20.0, torchscript: trace
    finally:
        services.close()
    engine = make_engine(empty_url, poolclass=pool.NullPool)

    def state() -> tuple[set[str], list[Any]]:
        with engine.connect() as conn:
            queues = set(conn.execute(text("SELECT queue FROM bucket_compiles")).scalars())
            kwargs = [row if isinstance(row, dict) else json.loads(row)
                      for row in conn.execute(text("SELECT kwargs FROM outbox WHERE sent_at IS NULL")).scalars()]
        return queues, [k.get("queue") for k in kwargs]

    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox SET sent_at = NULL"))  # as if the broker had been down
        new = queue_name("inf2", "2.20.0", "trace")
        assert state() == ({new}, [new, new])
        downgrade(empty_url, "0005_error_classes")
        assert state() == ({"compile.inf2.2.20.0"}, [None, None])
        upgrade(empty_url)
        assert state() == ({new}, [new, new])
    finally:
        engine.dispose()


def test_the_provenance_migration_gives_existing_compiles_the_build_that_made_them(empty_url: str,
                                                                                   tmp_path: Path) -> None:
    """0013: compiles that ran before it get the first new build of a set containing them as their origin
    (and its model name), so later builds that reuse them say from where; compiles that never ran here
    (imported) get none."""
    from compilesvc.compiles import leases
    from compilesvc.ledger.engine import transaction
    from compilesvc.services import Services
    from tests.compiles.test_leases import make_settings, submit

    upgrade(empty_url)
    services = Services.from_settings(make_settings(tmp_path, empty_url))
    try:
        first = submit(services, buckets=2)
        submit(services, buckets=2)  # a join of the same set: not the origin
        with transaction(services.sessions) as session:
            ran = session.execute(text("SELECT id FROM bucket_compiles WHERE key = :k"),
                                  {"k": first.buckets[0].key}).scalar_one()
            assert leases.claim(session, ran, "w", 60) is not None
    finally:
        services.close()
    engine = make_engine(empty_url, poolclass=pool.NullPool)
    try:
        downgrade(empty_url, "0012_event_subscriptions")
        upgrade(empty_url)
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT id, origin_build_id FROM bucket_compiles")).all())
            names = set(conn.execute(text("SELECT model_name FROM bucket_compiles WHERE id = :i"),
                                     {"i": ran}).scalars())
    finally:
        engine.dispose()
    assert rows[ran] == first.build_id and len(rows) == 2
    assert [origin for bucket_id, origin in rows.items() if bucket_id != ran] == [None]  # never started here
    assert names == {None}  # the spec gave the model no name


def test_the_policies_migration_counts_the_releases_workers_already_registered(empty_url: str) -> None:
    """0019: every (target, release) a registered worker serves is seen already (its first worker the one
    that started first), so a policy added after the upgrade fires for the next release only."""
    upgrade(empty_url, "0018_drain")
    engine = make_engine(empty_url, poolclass=pool.NullPool)
    workers = [("w-b", {"targets": ["inf2", "trn1"], "sdk": {"inf2": "2.24.0", "trn1": "2.24.0"}}, 2),
               ("w-a", {"targets": ["inf2", "cpu"], "sdk": {"inf2": "2.24.0", "cpu": "2.8.0"}}, 1),
               ("w-c", {"targets": [], "sdk": {}}, 3)]
    try:
        with engine.begin() as conn:
            for worker_id, caps, hour in workers:
                at = datetime(2026, 11, 26, hour, tzinfo=UTC)
                conn.execute(text("INSERT INTO workers (id, hostname, capabilities, queues, slots, started_at, "
                                  "heartbeat_at) VALUES (:id, 'h', :caps, :queues, 1, :at, :at)"),
                             {"id": worker_id, "caps": json.dumps(caps), "queues": "[]", "at": at})
        upgrade(empty_url)
        with engine.connect() as conn:
            seen = {tuple(row) for row in conn.execute(text("SELECT target, sdk, first_worker_id FROM sdk_releases"))}
        assert seen == {("inf2", "2.24.0", "w-a"), ("cpu", "2.8.0", "w-a"), ("trn1", "2.24.0", "w-b")}
    finally:
        engine.dispose()
