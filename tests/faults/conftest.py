"""The fault suite's fixtures: compilesvc run as production runs it, on infrastructure the test owns.

``faults`` gives a test a :class:`FaultCluster`: a private Postgres cluster, a private Redis and a private
``weed mini`` S3 server (:mod:`tests.fixtures.private_services`, :mod:`tests.fixtures.s3server`), with a
``compilesvc serve`` API (gunicorn, 2 processes) and a ``compilesvc relay`` already running on them, and
``start_workers()`` for the two ``compilesvc worker`` processes (started by the test, so it can choose
whether they consume before or after its fault). The test breaks what it likes (``faults.postgres.restart()``,
``faults.redis.flushall()``, ``faults.s3.stop()``...): nothing it touches is shared with anything else on the
machine. Work goes through the HTTP API as a CI pipeline's would (:class:`ApiClient`). Every process is
killed by pid at teardown, whatever the outcome; when the test failed, the processes' logs (with a stack
dump of each) stay in its tmp_path.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.faults.scale import SCALE
from tests.fixtures.ports import free_port
from tests.fixtures.private_services import PrivatePostgres, PrivateRedis
from tests.fixtures.s3server import WeedProcess
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.workers.conftest import HLO_MODEL, Cluster, ServiceProcess, cluster_factory, wait_for

#: How long S3 stays down in the outage tests: the run's scale (tests/faults/scale.py; CI 12 s, bench 60 s).
OUTAGE_SECONDS = max(SCALE.outage_seconds, SCALE.fetch_outage_seconds)

#: Settings of the recovery machinery, passed to every process. Settings ignores COMPILESVC_* variables it
#: does not know, so these are harmless where the code does not read them (yet).
RECOVERY_ENV = {
    # A queued compile whose message has been missing from the broker this long is sent again.
    "COMPILESVC_DISPATCH_GRACE_SECONDS": "2",
    "COMPILESVC_RETRY_BACKOFF_SECONDS": "1",
    "COMPILESVC_RETRY_BACKOFF_MAX_SECONDS": "5",
    # A publish keeps retrying through the whole outage, and then some.
    "COMPILESVC_STORE_RETRY_SECONDS": str(int(OUTAGE_SECONDS) + 120),
}

TERMINAL = ("succeeded", "failed", "cancelled")


class ApiClient:
    """What a CI pipeline does with the API: upload, submit (retrying 503 + Retry-After), poll."""

    def __init__(self, base: str):
        self.base = base
        self.http = requests.Session()
        self.http.headers.update(bearer(BOOTSTRAP_TOKEN))

    def upload(self, content: bytes) -> str:
        response = self.http.post(f"{self.base}/v1/models", data=io.BytesIO(content),
                                  headers={"Content-Type": "application/octet-stream"}, timeout=60)
        assert response.status_code in (200, 201), response.text
        return str(response.json()["uri"])

    def submit(self, spec: dict[str, Any], retry_for: float = 30, queue_anyway: bool = False) -> dict[str, Any]:
        """POST /v1/builds; a 503 is retried after its Retry-After (at most 2 s here), as is a refused
        connection, for up to ``retry_for`` seconds. Returns the 200/202 body."""
        deadline = time.monotonic() + retry_for
        params = {"queue_anyway": "true"} if queue_anyway else {}
        while True:
            wait = 1.0
            try:
                response = self.http.post(f"{self.base}/v1/builds", json=spec, params=params, timeout=30)
            except requests.ConnectionError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code in (200, 202):
                    return dict(response.json())
                retry_after = response.headers.get("Retry-After", "")
                if response.status_code != 503 or not retry_after.isdigit():
                    raise AssertionError(f"submit answered {response.status_code}: {response.text}")
                last = f"503 {response.text}"
                wait = min(float(retry_after), 2.0)
            if time.monotonic() > deadline:
                raise AssertionError(f"submit still refused after {retry_for:g}s: {last}")
            time.sleep(wait)

    def build(self, build_id: int) -> dict[str, Any] | None:
        """GET /v1/builds/{id}, or None while the API cannot answer (a dependency is down)."""
        try:
            response = self.http.get(f"{self.base}/v1/builds/{build_id}", timeout=30)
        except requests.ConnectionError:
            return None
        if response.status_code == 503:
            return None
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_builds(self, build_ids: list[int], timeout: float) -> list[dict[str, Any]]:
        """Poll until every build is terminal; on timeout, fail with where each one stands."""
        latest: dict[int, dict[str, Any] | None] = dict.fromkeys(build_ids)
        deadline = time.monotonic() + timeout
        while True:
            for build_id in build_ids:
                current = latest[build_id]
                if current is None or current["state"] not in TERMINAL:
                    latest[build_id] = self.build(build_id) or current
            if all(b is not None and b["state"] in TERMINAL for b in latest.values()):
                return [b for b in latest.values() if b is not None]
            if time.monotonic() > deadline:
                not_done = {i: summary(b) for i, b in latest.items() if b is None or b["state"] not in TERMINAL}
                raise AssertionError(f"{len(not_done)} of {len(build_ids)} builds not terminal after "
                                     f"{timeout:g}s: {not_done}")
            time.sleep(0.25)

    def log_lines(self, build_id: int) -> list[dict[str, Any]]:
        """Every central log line of the build, all attempts, oldest first."""
        lines: list[dict[str, Any]] = []
        after = 0
        while True:
            page = self.http.get(f"{self.base}/v1/builds/{build_id}/logs", params={"after": after, "limit": 1000},
                                 timeout=30)
            assert page.status_code == 200, page.text
            body = page.json()
            lines += body["lines"]
            if not body["lines"]:
                return lines
            after = body["next_after"]


def summary(build: dict[str, Any] | None) -> Any:
    """A build in one line: its state and each bucket's state, attempts and last error."""
    if build is None:
        return "unreadable"
    return {"state": build["state"], "buckets": [
        {k: b.get(k) for k in ("state", "attempts", "error_class", "error_code", "error_message", "errors")
         if b.get(k) is not None} for b in build["buckets"]]}


@dataclass
class FaultCluster:
    """One fault test's service and the infrastructure under it (see the module docstring)."""

    cluster: Cluster
    postgres: PrivatePostgres
    redis: PrivateRedis
    s3: WeedProcess
    api: ApiClient
    workers: list[ServiceProcess] = field(default_factory=list)
    _model_uri: str | None = None

    def start_workers(self, count: int = 2, concurrency: int = 1) -> list[ServiceProcess]:
        """``count`` ``compilesvc worker`` processes (``concurrency`` compiles each); waits until they consume."""
        started = [self.cluster.start_worker(f"w{len(self.workers) + i + 1}", concurrency=concurrency, wait=False)
                   for i in range(count)]
        for worker in started:
            worker.wait_ready()
        self.workers += started
        return started

    def hlo_spec(self, behaviour: str = "ok", seq_lens: tuple[int, ...] = (16,)) -> dict[str, Any]:
        """A spec for the Neuron double's fast neuronx-cc path, one bucket per ``seq_lens`` entry (distinct
        lengths: distinct compiles). The model is uploaded through the API once."""
        if self._model_uri is None:
            self._model_uri = self.api.upload(HLO_MODEL)
        spec = self.cluster.hlo_spec(behaviour, uri=self._model_uri)
        spec["buckets"] = [{"batch_size": 1, "seq_len": n} for n in seq_lens]
        return spec

    def broker_depth(self) -> int:
        """Messages waiting in the private Redis's compile queues (not the workers' liveness canaries,
        workers/liveness.py: a canary sent just before a compile took the slot waits behind it)."""
        client = self.redis.client()
        try:
            return sum(int(client.llen(key)) for key in client.scan_iter(match="compile.*")
                       if not key.startswith(b"compile.canary.") and client.type(key) == b"list")
        finally:
            client.close()

    def worker_records(self, msg: str, **fields: Any) -> list[dict[str, Any]]:
        """JSON log records ``msg`` (with ``fields``) of every worker this test started."""
        return [r for worker in self.workers for r in worker.logged(msg, **fields)]


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A migrated Postgres 15 cluster of this test's own (free port, unprivileged user, fsync off)."""
    postgres = PrivatePostgres()
    try:
        yield postgres.init()
    finally:
        postgres.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own that persists nothing."""
    server = PrivateRedis(tmp_path / "redis")
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def private_s3(tmp_path: Path) -> Iterator[WeedProcess]:
    """A ``weed mini`` of this test's own, stoppable and restartable on the same ports and data."""
    weed = WeedProcess(tmp_path / "weed")
    try:
        weed.start()
        yield weed
    finally:
        weed.kill()


@pytest.fixture
def faults(tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
           private_postgres: PrivatePostgres, private_redis: PrivateRedis,
           private_s3: WeedProcess) -> Iterator[FaultCluster]:
    """API + relay on the private Postgres, Redis and S3 (workers: ``faults.start_workers()``)."""
    s3_env = private_s3.server.env()
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)  # this process's Services (cluster.services) read the same store
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    bucket = private_s3.server.new_bucket("faults")
    with cluster_factory(tmp_path, request, database_url=private_postgres.url, broker_url=private_redis.url,
                         broker_key_prefix="") as make:
        cluster = make(store_url=f"s3://{bucket}/artifacts", extra_env={**s3_env, **RECOVERY_ENV},
                       s3_endpoint_url=private_s3.server.endpoint_url, public_url=base)
        cluster.start_api(port)
        cluster.start_relay()
        yield FaultCluster(cluster=cluster, postgres=private_postgres, redis=private_redis, s3=private_s3,
                           api=ApiClient(base))


__all__ = ["OUTAGE_SECONDS", "TERMINAL", "ApiClient", "FaultCluster", "summary", "wait_for"]
