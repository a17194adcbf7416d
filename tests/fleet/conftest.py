"""A fleet's view of compilesvc: the real API (SQLite ledger, local or S3 store) on a real socket, reached
through a :class:`RecordingRelay` (so a test counts every download and sees every Range), and the
``compilesvc fetch`` CLI run as the fleet host runs it, in subprocesses sharing one cache directory."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import BaseWSGIServer, make_server

from tests.fixtures.relay import RecordingRelay
from tests.fixtures.s3server import S3Server
from tests.fixtures.signing import trust_env
from tests.fixtures.tokens import make_token
from tests.web.conftest import (
    EnvFactory,
    make_env,  # noqa: F401  (the fixture, for this directory)
)
from tests.web.support import Env, complete_build, spec_for


def payload_of(size: int) -> Any:
    """Model bytes of ``size`` per bucket, different for every bucket key (so no two files share a blob)."""
    return lambda key: random.Random(key).randbytes(size) if size else f"compiled {key}".encode()


@dataclass
class FleetApi:
    env: Env
    relay: RecordingRelay
    server: BaseWSGIServer
    thread: threading.Thread
    cache: Path
    token: str = ""
    stopped: bool = field(default=False)

    @property
    def base(self) -> str:
        return self.relay.base

    def publish(self, *, buckets: tuple[tuple[int, int], ...] = ((1, 8), (2, 8)), size: int = 0,
                model: bytes = b"m", versions: dict[str, Any] | None = None,
                payload: Callable[[str], bytes] | None = None,
                files: Callable[[str], dict[str, tuple[str, bytes]]] | None = None) -> str:
        """Publish an artifact (the worker's core paths, no compiler) with ``size``-byte model files (or
        ``payload(bucket key)``, or each bucket's ``files(bucket key)``: path -> (role, bytes))."""
        uri = self.env.upload(model)
        response = self.env.submit(spec_for(uri, buckets=buckets))
        assert response.status_code == 202, response.get_data(as_text=True)
        complete_build(self.env.services, response.json["build_id"], payload=payload or payload_of(size),
                       versions=versions, files=files)
        return str(response.json["artifact_key"])

    def manifest(self, key: str) -> dict[str, Any]:
        response = self.env.client.get(f"/v1/artifacts/{key}")
        assert response.status_code == 200
        return dict(response.json)

    def environ(self) -> dict[str, str]:
        return {**os.environ, "COMPILESVC_TOKEN": self.token, "COMPILESVC_API_URL": self.base,
                "COMPILESVC_CACHE_DIR": str(self.cache), **trust_env(self.env.services)}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "compilesvc", "fetch", *args]

    def fetch(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.environ())

    def fetch_json(self, *args: str) -> dict[str, Any]:
        result = self.fetch(*args, "--json")
        assert result.returncode == 0, result.stderr
        return dict(json.loads(result.stdout))

    def blob_gets(self, sha256: str) -> int:
        return len([s for s in self.relay.requests_for(f"/v1/blobs/{sha256}") if s.method == "GET"])

    def stop(self) -> None:
        """The API goes away: nothing answers on its address any more."""
        if not self.stopped:
            self.stopped = True
            self.relay.close()
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(10)


@contextlib.contextmanager
def serving(make: Callable[[str], Env], tmp_path: Path) -> Iterator[FleetApi]:
    """The app made by ``make(public_url)`` on a socket behind a relay, with a fleet token; this process
    trusts the app's signing key (``ArtifactSet.open`` in a test reads it from the environment)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    relay = RecordingRelay(port)
    env = make(relay.base)
    server = make_server("127.0.0.1", port, env.app, threaded=True, fd=listener.fileno())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = FleetApi(env, relay, server, thread, tmp_path / "fleet-cache")
    api.token = make_token(env.services.sessions, "fleet", owner="fleet")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in trust_env(env.services).items():
            patch.setenv(name, value)
        try:
            yield api
        finally:
            api.stop()


@pytest.fixture
def fleet_api(make_env: EnvFactory, sqlite_url: str, tmp_path: Path) -> Iterator[FleetApi]:  # noqa: F811
    """The API with a local store: downloads go through the relay too."""
    with serving(lambda url: make_env(sqlite_url, public_url=url), tmp_path) as api:
        yield api


@pytest.fixture
def fleet_api_s3(make_env: EnvFactory, sqlite_url: str, tmp_path: Path, s3_server: S3Server,  # noqa: F811
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetApi]:
    """The API with its store in the real S3 server: downloads are presigned GETs straight to it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.new_bucket("fleet")
    with serving(lambda url: make_env(sqlite_url, public_url=url, store_url=f"s3://{bucket}/artifacts",
                                      s3_endpoint_url=s3_server.endpoint_url), tmp_path) as api:
        yield api
