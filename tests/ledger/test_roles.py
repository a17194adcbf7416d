"""Ledger roles on the real Postgres: ``compilesvc migrate --grant-api R --grant-worker R`` leaves an API
role that reads and writes rows, a worker role that cannot touch tokens, sessions or idempotent answers,
and neither can change the schema or its version. Roles are made here with unique names and dropped."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ProgrammingError

from compilesvc.access.tokens import create_token
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Base
from compilesvc.ledger.roles import WORKER_DENIED
from tests.cli.test_main import CLI, clean_env
from tests.fixtures.ledger import PG_ADMIN_URL, create_pg_database, drop_pg_database


def _admin() -> Engine:
    return create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


@pytest.fixture
def roles_db() -> Iterator[tuple[str, str, str]]:
    """A fresh, unmigrated database and two new login roles (api, worker)."""
    suffix = uuid.uuid4().hex[:8]
    api, worker = f"csvc_test_api_{suffix}", f"csvc_test_worker_{suffix}"
    admin = _admin()
    with admin.connect() as conn:
        for role in (api, worker):
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
    url = create_pg_database("compilesvc_roles")
    try:
        yield url, api, worker
    finally:
        drop_pg_database(url)
        with admin.connect() as conn:
            for role in (api, worker):
                conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


def as_role(url: str, role: str) -> Engine:
    return create_engine(url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://{role}@"))


def can(engine: Engine, sql: str) -> bool:
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
        return True
    except ProgrammingError as exc:
        assert "permission denied" in str(exc) or "must be owner" in str(exc), exc
        return False


def test_migrate_grants_each_role_its_rights_and_no_more(roles_db: tuple[str, str, str], tmp_path: Path) -> None:
    url, api, worker = roles_db
    done = subprocess.run([str(CLI), "migrate", "--database-url", url, "--grant-api", api, "--grant-worker", worker],
                          env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"granted {api} (api) and {worker} (worker)" in done.stdout

    api_engine, worker_engine = as_role(url, api), as_role(url, worker)
    try:
        # The API makes tokens (its sequence included) and reads every table.
        from sqlalchemy.orm import sessionmaker

        with transaction(sessionmaker(api_engine)) as session:
            create_token(session, name="t", owner="o", scopes=("read",))
        for table in Base.metadata.sorted_tables:
            assert can(api_engine, f'SELECT 1 FROM "{table.name}" LIMIT 1'), table.name
        # The workers read and write every table but those three.
        for table in Base.metadata.sorted_tables:
            expected = table.name not in WORKER_DENIED
            assert can(worker_engine, f'SELECT 1 FROM "{table.name}" LIMIT 1') == expected, table.name
        assert not can(worker_engine, "UPDATE api_tokens SET revoked_at = NULL")
        assert not can(worker_engine, "DELETE FROM ui_sessions")
        assert can(worker_engine, "UPDATE bucket_compiles SET attempts = attempts WHERE false")
        # Neither changes the schema or its version.
        for engine in (api_engine, worker_engine):
            assert can(engine, "SELECT version_num FROM alembic_version")
            assert not can(engine, "UPDATE alembic_version SET version_num = version_num")
            assert not can(engine, "CREATE TABLE intruder (id int)")
            assert not can(engine, "DROP TABLE builds")
            assert not can(engine, "ALTER TABLE builds ADD COLUMN x int")
    finally:
        api_engine.dispose()
        worker_engine.dispose()

    # Again (every migrate in compose does this): idempotent.
    again = subprocess.run([str(CLI), "migrate", "--database-url", url, "--grant-api", api, "--grant-worker",
                            worker], env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr


def test_grant_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    sqlite = f"sqlite:///{tmp_path / 'l.db'}"
    alone = subprocess.run([str(CLI), "migrate", "--database-url", sqlite, "--grant-api", "a"],
                           env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "go together" in alone.stderr
    on_sqlite = subprocess.run([str(CLI), "migrate", "--database-url", sqlite, "--grant-api", "a", "--grant-worker",
                                "b"], env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert on_sqlite.returncode == 2 and "need a Postgres ledger" in on_sqlite.stderr
    bad = create_pg_database("compilesvc_roles")
    try:
        named = subprocess.run([str(CLI), "migrate", "--database-url", bad, "--grant-api", "x; DROP", "--grant-worker",
                                "b"], env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert named.returncode == 2 and "not a plain role name" in named.stderr
        missing = subprocess.run([str(CLI), "migrate", "--database-url", bad, "--grant-api", "no_such_role_x",
                                  "--grant-worker", "no_such_role_y"], env=clean_env(tmp_path), capture_output=True,
                                 text=True, timeout=300)
        assert missing.returncode == 1 and "granting failed" in missing.stderr
        assert len(missing.stderr.strip().splitlines()) == 1
    finally:
        drop_pg_database(bad)


def test_the_compose_init_script_makes_the_roles_and_is_idempotent(tmp_path: Path) -> None:
    """docker/postgres/roles.sh, run as postgres's entrypoint runs it (psql as the owner), then again."""
    import shutil

    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    suffix = uuid.uuid4().hex[:8]
    api, worker = f"csvc_init_api_{suffix}", f"csvc_init_worker_{suffix}"
    script = Path(__file__).resolve().parents[2] / "docker" / "postgres" / "roles.sh"
    env = {"PATH": "/usr/bin:/bin", "PGHOST": "127.0.0.1", "POSTGRES_USER": "postgres", "POSTGRES_DB": "postgres",
           "POSTGRES_API_PASSWORD": "it's a 'quoted' secret", "POSTGRES_WORKER_PASSWORD": "another-secret",
           "COMPILESVC_API_ROLE": api, "COMPILESVC_WORKER_ROLE": worker}
    admin = _admin()
    try:
        for _ in range(2):
            done = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        with admin.connect() as conn:
            rows = conn.execute(text("SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, "
                                     "rolpassword IS NOT NULL FROM pg_authid WHERE rolname IN (:a, :w) ORDER BY 1"),
                                {"a": api, "w": worker}).all()
        assert [tuple(r) for r in rows] == [(api, True, False, False, False, True),
                                            (worker, True, False, False, False, True)]
        missing = subprocess.run(["sh", str(script)], env={**env, "POSTGRES_WORKER_PASSWORD": ""},
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode != 0 and "POSTGRES_WORKER_PASSWORD must be set" in missing.stderr
    finally:
        with admin.connect() as conn:
            for role in (api, worker):
                conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def test_the_init_script_runs_as_an_rds_master_user(tmp_path: Path) -> None:
    """RDS's master user holds CREATEROLE and CREATEDB but is not a superuser (RDS user guide, "Master user
    account privileges"); Postgres refuses a SUPERUSER/NOSUPERUSER clause from a non-superuser ("must be
    superuser to alter superuser roles or change superuser attribute", src/backend/commands/user.c AlterRole,
    REL_15). Roles are cluster-wide, so this runs on a private cluster, never on the shared one."""
    import shutil

    from tests.fixtures.private_services import PrivatePostgres

    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    cluster = PrivatePostgres()
    try:
        cluster.init()
        admin = f"postgresql://postgres@127.0.0.1:{cluster.port}/postgres"
        import psycopg

        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE ROLE rds_master LOGIN CREATEROLE CREATEDB")
        script = Path(__file__).resolve().parents[2] / "docker" / "postgres" / "roles.sh"
        env = {"PATH": "/usr/bin:/bin", "PGHOST": "127.0.0.1", "PGPORT": str(cluster.port),
               "POSTGRES_USER": "rds_master", "POSTGRES_DB": "postgres",
               "POSTGRES_API_PASSWORD": "api-secret", "POSTGRES_WORKER_PASSWORD": "worker-secret"}
        for _ in range(2):  # idempotent as the master user too
            done = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        with psycopg.connect(admin, autocommit=True) as conn:
            rows = conn.execute("SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, "
                                "rolpassword IS NOT NULL FROM pg_authid WHERE rolname LIKE 'compilesvc_%' "
                                "ORDER BY 1").fetchall()
            assert rows == [("compilesvc_api", True, False, False, False, True),
                            ("compilesvc_worker", True, False, False, False, True)]
            # A role of that name that is a superuser cannot be tamed by a non-superuser: the script fails
            # whole, in one transaction, and leaves the other role as it was.
            conn.execute("DROP ROLE compilesvc_worker")
            conn.execute("ALTER ROLE compilesvc_api SUPERUSER")
        refused = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "must be superuser" in refused.stderr
        with psycopg.connect(admin, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM pg_roles WHERE rolname = 'compilesvc_worker'").fetchone() == (0,)
    finally:
        cluster.close()
