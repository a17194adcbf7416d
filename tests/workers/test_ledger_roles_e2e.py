"""The compose stack's ledger roles with real processes: a worker logged in as the workers' role (no
tokens, sessions or idempotent answers; no schema) and a relay as the API's role compile and publish a
build end to end on the real Postgres and Redis, holding neither the bootstrap token nor the secret key."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text

from compilesvc.ledger_roles import grant
from tests.fixtures.ledger import PG_ADMIN_URL
from tests.workers.conftest import Cluster

MakeCluster = Callable[..., Cluster]


@pytest.fixture
def roles(pg_url: str) -> Iterator[tuple[str, str]]:
    """Two new login roles granted as ``compilesvc migrate --grant-…`` grants them, dropped afterwards."""
    suffix = uuid.uuid4().hex[:8]
    api, worker = f"csvc_e2e_api_{suffix}", f"csvc_e2e_worker_{suffix}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for role in (api, worker):
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
    owner = create_engine(pg_url)
    grant(owner, api, worker)
    try:
        yield api, worker
    finally:
        with owner.begin() as conn:
            for role in (api, worker):
                conn.execute(text(f"DROP OWNED BY {role}"))  # its grants on this database
        owner.dispose()
        with admin.connect() as conn:
            for role in (api, worker):
                conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


def test_a_build_compiles_and_publishes_with_the_least_privileged_roles(make_cluster: MakeCluster, pg_url: str,
                                                                       roles: tuple[str, str]) -> None:
    api_role, worker_role = roles
    as_role = {role: pg_url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://{role}@")
               for role in roles}
    cluster = make_cluster()
    # As compose gives them: the workers hold neither the bootstrap token nor the secret key.
    cluster.start_worker("w1", concurrency=2, env={"COMPILESVC_DATABASE_URL": as_role[worker_role],
                                                   "COMPILESVC_BOOTSTRAP_TOKEN": "", "COMPILESVC_SECRET_KEY": ""})
    cluster.start_relay(env={"COMPILESVC_DATABASE_URL": as_role[api_role]})
    result = cluster.submit(cluster.hlo_spec("ok", buckets=2))
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), 60)
    assert artifact.state == "published", [cluster.bucket(b.key).error_message for b in result.buckets]
    assert all(cluster.bucket(b.key).worker_id == "w1@test" for b in result.buckets)
    with cluster.services.sessions() as session:  # the processes really logged in as those roles
        users = set(session.scalars(text("SELECT usename FROM pg_stat_activity WHERE datname = current_database()")))
    assert {api_role, worker_role} <= users, users
    for process in cluster.processes:
        log = process.log_path.read_text()
        assert "permission denied" not in log and "InsufficientPrivilege" not in log, (process.name, log[-2000:])
