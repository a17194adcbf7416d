"""The stack an attack runs against: API, one worker and the relay as real processes, in two layouts.

- ``embedded``: what ``compilesvc dev`` lays out: a SQLite ledger, the local artifact store, kombu's
  filesystem broker, the admin token (``<data dir>/admin-token``, made by
  :func:`compilesvc.cli.dev.admin_token`) and the generated URL-signing key (``<data dir>/secret_key``)
  all in one data directory.
- ``s3``: Postgres (a database of its own, its URL carrying a password), Redis under a key prefix of its
  own, and the ``weed`` S3 server; the worker holds the S3 credentials, the ledger URL, the secret key and
  the bootstrap token in its environment, as docker-compose gives them.

In both, the worker's ``HOME`` holds a ``.aws/credentials`` file and its environment AWS and COMPILESVC
secrets, so that reading them is a real attempt; its ``TMPDIR`` is the stack's own, so its work root is
known. Processes come from :func:`tests.workers.conftest.cluster_factory`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from compilesvc.cli.dev import ADMIN_TOKEN_FILE, admin_token
from compilesvc.config.settings import Settings
from compilesvc.ledger.migrate import upgrade
from compilesvc.store.base import artifact_manifest_name, blob_name
from tests.fixtures.ledger import create_pg_database, drop_pg_database
from tests.fixtures.ports import free_port
from tests.fixtures.s3server import S3Server
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer, make_token
from tests.workers.conftest import REDIS_URL, Cluster, ServiceProcess, cluster_factory, delete_redis_keys

KINDS = ("embedded", "s3")
CPU_SDK = "2.13.0"
#: Small limits, so the limit attacks end fast and write little (the disk attack writes ~36 MiB in all).
LIMITS = {"compile_timeout_seconds": 45, "sandbox_memory_mb": 2048, "sandbox_max_file_mb": 16,
          "sandbox_max_disk_mb": 24, "sandbox_tmp_mb": 16}


@dataclass
class Stack:
    kind: str
    cluster: Cluster
    base: str
    worker: ServiceProcess
    admin: requests.Session
    attacker: requests.Session  # a submit token of team "red"
    victim: requests.Session  # a submit token of team "blue"
    data_dir: Path
    home: Path
    work_root: Path
    #: Secret values by name: none may appear in any answer an attacker gets.
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def local_store(self) -> Path | None:
        return self.data_dir / "artifacts" if self.kind == "embedded" else None

    @property
    def ledger_file(self) -> Path | None:
        return self.data_dir / "compilesvc.db" if self.kind == "embedded" else None

    # -- the API, as a team sees it -----------------------------------------------------------------

    def upload(self, http: requests.Session, content: bytes) -> str:
        answer = http.post(f"{self.base}/v1/models", data=io.BytesIO(content),
                           headers={"Content-Type": "application/octet-stream"})
        assert answer.status_code == 201, answer.text
        return str(answer.json()["uri"])

    def submit(self, http: requests.Session, content: bytes, name: str) -> dict[str, Any]:
        spec = {"model": {"uri": self.upload(http, content), "format": "torchscript", "name": name},
                "target": "cpu", "sdk": CPU_SDK, "compiler": {"backend": "torchscript"},
                "buckets": [{"batch_size": 1, "seq_len": 8}], "labels": {"attack": name}}
        answer = http.post(f"{self.base}/v1/builds", json=spec)
        assert answer.status_code == 202, answer.text
        return dict(answer.json())

    def build(self, http: requests.Session, build_id: int) -> dict[str, Any]:
        answer = http.get(f"{self.base}/v1/builds/{build_id}")
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    # -- what a victim's published artifact is, byte for byte ---------------------------------------

    def artifact_files(self, key: str) -> dict[str, str]:
        """sha256 of the artifact's manifest and of every blob it names (log included), read from the store
        behind the API's back: ``{store name: sha256 of the stored bytes}``."""
        store = self.cluster.services.store
        raw = store.read_document(artifact_manifest_name(key))
        assert raw is not None, f"no manifest for {key}"
        digests = {artifact_manifest_name(key): hashlib.sha256(raw).hexdigest()}
        manifest = self.admin.get(f"{self.base}/v1/artifacts/{key}").json()
        for bucket in manifest["buckets"]:
            for entry in [*bucket["files"], bucket["log"]]:
                with store.open_blob(entry["sha256"]) as blob:
                    digests[blob_name(entry["sha256"])] = hashlib.sha256(blob.read()).hexdigest()
        return digests


def _session(token: str) -> requests.Session:
    http = requests.Session()
    http.headers.update(bearer(token))
    return http


def _fake_home(home: Path, key_id: str, secret: str) -> None:
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
    (home / ".aws" / "credentials").chmod(0o600)


@contextlib.contextmanager
def running_stack(kind: str, tmp: Path, request: pytest.FixtureRequest,
                  s3: S3Server | None = None) -> Iterator[Stack]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data_dir, home, worker_tmp = tmp / "data", tmp / "worker-home", tmp / "worker-tmp"
    worker_tmp.mkdir()
    file_key_id, file_secret = f"AKIAFILE{secrets.token_hex(6).upper()}", secrets.token_urlsafe(30)
    _fake_home(home, file_key_id, file_secret)
    found: dict[str, str] = {"bootstrap token": BOOTSTRAP_TOKEN, "credentials file key id": file_key_id,
                             "credentials file secret": file_secret}
    worker_env = {"HOME": str(home), "TMPDIR": str(worker_tmp)}
    settings: dict[str, Any] = {"public_url": base, "max_attempts": 1, "lease_seconds": 30,
                                "heartbeat_seconds": 1, **LIMITS}
    cleanup: list[Any] = []
    if kind == "embedded":
        env_key_id, env_secret = f"AKIAENV{secrets.token_hex(6).upper()}", secrets.token_urlsafe(30)
        worker_env.update({"AWS_ACCESS_KEY_ID": env_key_id, "AWS_SECRET_ACCESS_KEY": env_secret})
        found.update({"environment AWS key id": env_key_id, "environment AWS secret": env_secret})
        data_dir.mkdir()
        embedded = Settings(data_dir=data_dir)
        upgrade(embedded.resolved_database_url)
        token, _ = admin_token(embedded)
        found["admin token (data dir)"] = token
        found["URL-signing key (data dir)"] = embedded.resolved_secret_key.decode()
        settings.update(store_url=(data_dir / "artifacts").as_uri(), secret_key="")
        factory = cluster_factory(tmp, request, **settings)
    else:
        assert s3 is not None
        password = secrets.token_urlsafe(18)
        # Postgres here trusts local connections: the password is never checked, only carried, as a real one is.
        database = create_pg_database("compilesvc_attacks")
        upgrade(database)
        cleanup.append(lambda: drop_pg_database(database))
        prefix = f"compilesvc-attacks-{uuid.uuid4().hex[:10]}:"
        cleanup.append(lambda: delete_redis_keys(prefix))
        secret_key = secrets.token_urlsafe(32)
        # The S3 access key id is public by design (every presigned URL names it): its secret key is not.
        found.update({"ledger password": password, "secret key": secret_key, "S3 secret key": s3.secret_key})
        settings.update(database_url=database.replace("postgres@", f"postgres:{password}@", 1),
                        broker_url=REDIS_URL, broker_key_prefix=prefix, secret_key=secret_key,
                        s3_endpoint_url=s3.endpoint_url,
                        store_url=f"s3://{s3.new_bucket('attacks')}/artifacts")
        worker_env.update(s3.env())
        factory = cluster_factory(tmp, request, **settings)
    try:
        with factory as make:
            cluster = make(extra_env=s3.env() if s3 is not None else None)
            cluster.start_api(port)
            worker = cluster.start_worker("worker", concurrency=3, env=worker_env)
            cluster.start_relay()
            sessions = cluster.services.sessions
            stack = Stack(kind, cluster, base, worker, _session(BOOTSTRAP_TOKEN),
                          _session(make_token(sessions, "submit", owner="mallory", team="red")),
                          _session(make_token(sessions, "submit", owner="bob", team="blue")),
                          data_dir, home, worker_tmp / "compilesvc-work-0", found)
            yield stack
    finally:
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                step()


def secret_file_paths(stack: Stack) -> dict[str, Path]:
    """The files holding the stack's secrets, as the worker's host has them."""
    paths = {"credentials": stack.home / ".aws" / "credentials"}
    if stack.kind == "embedded":
        paths.update({"admin token": stack.data_dir / ADMIN_TOKEN_FILE, "secret key": stack.data_dir / "secret_key",
                      "ledger": stack.data_dir / "compilesvc.db"})
    return paths
