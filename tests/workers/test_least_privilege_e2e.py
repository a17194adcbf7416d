"""The compose stack's least privilege with real processes: an API process, a worker and a relay, each with
the credentials compose gives it, take a build from the HTTP submit to a published artifact on the real
Postgres, a ``weed mini`` serving docker/seaweedfs/identities.sh's config and a redis-server serving
docker/redis/users.sh's users (started by docker/redis/start.sh). The worker logs in as the workers' ledger
role (no tokens, sessions or idempotent answers; no schema), S3 identity and Redis user, holding neither the
bootstrap token nor the secret key; the relay as the API's role with the relay's identity and Redis user;
the API as the API's role, identity and Redis user (publishing after commit, counting the submit, answering
/readyz). Redis refuses none of what they send."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from sqlalchemy import create_engine, text

from compilesvc.ledger.roles import grant
from tests.deploy.test_redis_users import acl_redis, broker_url, denials
from tests.fixtures.ledger import PG_ADMIN_URL
from tests.fixtures.ports import free_port
from tests.fixtures.private_services import PrivateRedis
from tests.fixtures.s3server import ACCESS_KEY, SECRET_KEY, WeedProcess
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.fixtures.waiting import wait_for
from tests.pinning.test_s3_models import BUCKET, KEYS, PREFIX, client, write_config
from tests.workers.conftest import Cluster, cluster_factory

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


@pytest.fixture
def users(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own with compose's Redis users (the admin's client: ``.client()``)."""
    server = acl_redis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def make_acl_cluster(tmp_path: Path, pg_url: str, users: PrivateRedis,
                     request: pytest.FixtureRequest) -> Iterator[MakeCluster]:
    """Clusters on the session's ledger and ``users``' Redis; this test process is the API (its user)."""
    with cluster_factory(tmp_path, request, database_url=pg_url, broker_url=broker_url(users, "api")) as make:
        yield make


def s3_env(endpoint: str, service: str) -> dict[str, str]:
    access, secret = KEYS[service]
    return {"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
            "COMPILESVC_S3_ENDPOINT_URL": endpoint}


def test_a_build_compiles_and_publishes_with_the_least_privileged_roles(
        make_acl_cluster: MakeCluster, pg_url: str, roles: tuple[str, str], identities: str, users: PrivateRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    api_role, worker_role = roles
    as_role = {role: pg_url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://{role}@")
               for role in roles}
    # This test process uploads the model as the API does: with the API's S3 identity.
    for name, value in s3_env(identities, "api").items():
        monkeypatch.setenv(name, value)
    # A short grace: the relay's reconciler looks at the queue while the build waits for its worker.
    cluster = make_acl_cluster(store_url=f"s3://{BUCKET}/{PREFIX}", s3_endpoint_url=identities,
                               extra_env=s3_env(identities, "api"), dispatch_grace_seconds=0.5)
    admin = users.client()
    admin.acl_log_reset()
    port = free_port()
    cluster.start_api(port, env={"COMPILESVC_DATABASE_URL": as_role[api_role],
                                 "COMPILESVC_BROKER_URL": broker_url(users, "api")})
    cluster.start_relay(env={"COMPILESVC_DATABASE_URL": as_role[api_role],
                             "COMPILESVC_BROKER_URL": broker_url(users, "relay"), **s3_env(identities, "relay")})
    submitted = requests.post(f"http://127.0.0.1:{port}/v1/builds?queue_anyway=true",
                              json=cluster.hlo_spec("ok", buckets=2),
                              headers=bearer(BOOTSTRAP_TOKEN), timeout=60)
    assert submitted.status_code == 202, submitted.text
    wait_for(lambda: "relay" in {c["user"] for c in admin.client_list()}, 30, "the relay's reconciler to read")
    # As compose gives them: the workers hold neither the bootstrap token nor the secret key.
    cluster.start_worker("w1", concurrency=2, env={"COMPILESVC_DATABASE_URL": as_role[worker_role],
                                                   "COMPILESVC_BOOTSTRAP_TOKEN": "", "COMPILESVC_SECRET_KEY": "",
                                                   "COMPILESVC_BROKER_URL": broker_url(users, "worker"),
                                                   **s3_env(identities, "worker")})
    key = submitted.json()["artifact_key"]
    artifact = cluster.wait_artifact(key, ("published", "failed"), 60)
    buckets = [cluster.bucket(b["key"]) for b in submitted.json()["buckets"]]
    assert artifact.state == "published", [b.error_message for b in buckets]
    assert all(b.worker_id == "w1@test" for b in buckets)
    with cluster.services.sessions() as session:  # the processes really logged in as those roles
        pg_users = set(session.scalars(text("SELECT usename FROM pg_stat_activity WHERE datname = current_database()")))
    assert {api_role, worker_role} <= pg_users, pg_users
    # ... and as their Redis users, which Redis refused nothing; the API counted the submit there.
    assert {"api", "relay", "worker"} <= {c["user"] for c in admin.client_list()}
    assert denials(admin) == [], denials(admin)
    assert admin.keys("compilesvc-limits:*")
    for process in cluster.processes:
        log = process.log_path.read_text()
        assert "permission denied" not in log and "InsufficientPrivilege" not in log, (process.name, log[-2000:])
        assert "AccessDenied" not in log and "NOPERM" not in log, (process.name, log[-2000:])
    keys = {o["Key"] for o in client(identities, ACCESS_KEY, SECRET_KEY).list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert f"{PREFIX}/artifacts/{key}/manifest.json" in keys
    assert sum(k.startswith(f"{PREFIX}/buckets/") for k in keys) == 2
    admin.close()
