"""Spot interruption notices (workers/host/spot.py): a worker that watches EC2's instance metadata drains
with the spot window when the notice appears.

The metadata service cannot exist here; :class:`Imds` plays it as the AWS EC2 User Guide describes it
("Spot Instance interruption notices"; "Use the Instance Metadata Service to access instance metadata"):
IMDSv2 wants a session token from ``PUT /latest/api/token`` (with ``X-aws-ec2-metadata-token-ttl-seconds``)
on every GET, answering 401 without a valid one; ``spot/instance-action`` is 404 until the instance is
marked for interruption, then ``{"action": "terminate", "time": "<UTC>"}``."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.workers.conftest import Cluster, wait_for
from workers.host.spot import SpotWatcher

MakeCluster = Callable[..., Cluster]
NOTICE = {"action": "terminate", "time": "2026-11-26T16:00:00Z"}


class Imds(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.marked = False
        self.tokens: set[str] = set()
        self.gets = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Imds

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(400)
        token = f"token-{len(self.server.tokens)}"
        self.server.tokens.add(token)
        self._answer(200, token)

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
            return self._answer(401)
        self.server.gets += 1
        if self.path != "/latest/meta-data/spot/instance-action" or not self.server.marked:
            return self._answer(404)
        self._answer(200, json.dumps(NOTICE))


@pytest.fixture
def imds() -> Iterator[Imds]:
    server = Imds()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_watcher_reports_the_notice_once_it_appears(imds: Imds) -> None:
    seen: list[tuple[str, str]] = []
    watcher = SpotWatcher(imds.url, lambda action, when: seen.append((action, when)), interval=0.05).start()
    wait_for(lambda: imds.gets >= 3, 10, "a few polls")
    assert seen == []  # 404: not marked
    imds.tokens.clear()  # the token expired: the watcher gets a new one and goes on
    imds.marked = True
    watcher.thread.join(10)
    assert seen == [("terminate", NOTICE["time"])] and not watcher.thread.is_alive()


@pytest.mark.slow
def test_a_spot_notice_hands_back_a_running_compile_within_the_spot_window(make_cluster: MakeCluster,
                                                                             imds: Imds) -> None:
    cluster = make_cluster(lease_seconds=60, heartbeat_seconds=2, drain_seconds=300, spot_notice=True,
                           spot_drain_seconds=2, imds_url=imds.url)
    worker = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:60"))
    key = result.buckets[0].key
    wait_for(lambda: worker.logged("compiler started"), 30, "the compiler to start")
    assert imds.gets > 0  # polled while compiling

    imds.marked = True
    noticed = time.monotonic()
    assert worker.proc.wait(30) == 0, "the worker should stop long before its 300 s drain window"
    assert time.monotonic() - noticed < 25
    assert worker.logged("spot interruption notice") and worker.logged("compile handed back")
    bucket = cluster.bucket(key)
    assert (bucket.state, bucket.attempts, bucket.interruptions) == ("queued", 1, 1)
    assert worker.proc.returncode != -signal.SIGKILL
