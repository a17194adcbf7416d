"""The compose stack's least privilege with real processes: a worker logged in as the workers' ledger role
(no tokens, sessions or idempotent answers; no schema) with the workers' S3 identity, and a relay as the
API's role with the relay's identity, compile and publish a build end to end on the real Postgres, Redis
and a ``weed mini`` serving docker/seaweedfs/identities.sh's config, holding neither the bootstrap token
nor the secret key."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from compilesvc.ledger_roles import grant
from tests.fixtures.ledger import PG_ADMIN_URL
from tests.fixtures.s3server import ACCESS_KEY, SECRET_KEY, WeedProcess
from tests.test_s3_identities import BUCKET, KEYS, PREFIX, client, write_config
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


@pytest.fixture
def identities(tmp_path: Path) -> Iterator[str]:
    """A real ``weed mini`` with compose's identities and the store's bucket; its S3 endpoint."""
    done = write_config(tmp_path / "identities.json")
    assert done.returncode == 0, done.stderr
    weed = WeedProcess(tmp_path / "weed", (tmp_path / "identities.json").read_text())
    server = weed.start()
    try:
        client(server.endpoint_url, ACCESS_KEY, SECRET_KEY).create_bucket(Bucket=BUCKET)
        yield server.endpoint_url
    finally:
        weed.kill()


def s3_env(endpoint: str, service: str) -> dict[str, str]:
    access, secret = KEYS[service]
    return {"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
            "COMPILESVC_S3_ENDPOINT_URL": endpoint}


def test_a_build_compiles_and_publishes_with_the_least_privileged_roles(
        make_cluster: MakeCluster, pg_url: str, roles: tuple[str, str], identities: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    api_role, worker_role = roles
    as_role = {role: pg_url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://{role}@")
               for role in roles}
    # This test process submits and uploads as the API does: with the API's S3 identity.
    for name, value in s3_env(identities, "api").items():
        monkeypatch.setenv(name, value)
    cluster = make_cluster(store_url=f"s3://{BUCKET}/{PREFIX}", s3_endpoint_url=identities,
                           extra_env=s3_env(identities, "api"))
    # As compose gives them: the workers hold neither the bootstrap token nor the secret key.
    cluster.start_worker("w1", concurrency=2, env={"COMPILESVC_DATABASE_URL": as_role[worker_role],
                                                   "COMPILESVC_BOOTSTRAP_TOKEN": "", "COMPILESVC_SECRET_KEY": "",
                                                   **s3_env(identities, "worker")})
    cluster.start_relay(env={"COMPILESVC_DATABASE_URL": as_role[api_role], **s3_env(identities, "relay")})
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
        assert "AccessDenied" not in log, (process.name, log[-2000:])
    keys = {o["Key"] for o in client(identities, ACCESS_KEY, SECRET_KEY).list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert f"{PREFIX}/artifacts/{result.artifact_key}/manifest.json" in keys
    assert sum(k.startswith(f"{PREFIX}/buckets/") for k in keys) == 2
