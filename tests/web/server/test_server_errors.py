"""``compilesvc serve``'s own protocol errors, over raw sockets against the real server: what gunicorn
refuses before Flask sees a request is problem+json too (web/server/httpworker.py), heads and bodies that stop
arriving are cut off, and X-Forwarded-For is believed from trusted peers only (web/server/proxied.py)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.fixtures.serve import Served, compilesvc_serve
from tests.fixtures.tokens import BOOTSTRAP_TOKEN


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with compilesvc_serve(tmp_path_factory.mktemp("serve"), ["--header-timeout", "1", "--io-timeout", "2"],
                          workers=1) as server:
        yield server


def exchange(served: Served, data: bytes, wait: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` and read until the server closes (or ``wait`` passes): status, headers, body."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=wait) as sock:
        sock.sendall(data)
        raw = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            raw += chunk
            head, sep, body = raw.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), raw[:300]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def assert_problem(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict[str, object]:
    assert status == expected, body
    assert headers["content-type"] == "application/problem+json"
    document = json.loads(body)
    assert document["status"] == expected
    assert document["type"] and document["title"] and document["detail"], document
    return dict(document)


def test_over_long_request_line_is_414_problem_json(served: Served) -> None:
    document = assert_problem(*exchange(served, b"GET /v1/artifacts/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n"),
                              expected=414)
    assert document["title"] == "URI Too Long" and "8190" in str(document["detail"])


def test_malformed_request_line_is_400_problem_json(served: Served) -> None:
    document = assert_problem(*exchange(served, b"NOT AN HTTP REQUEST\r\n\r\n"), expected=400)
    assert document["title"] == "Bad Request"


def test_too_many_header_fields_is_431_problem_json(served: Served) -> None:
    fields = b"".join(b"X-Field-%d: v\r\n" % i for i in range(80))
    assert_problem(*exchange(served, b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n"), expected=431)


def test_a_head_that_stops_arriving_is_408(served: Served) -> None:
    started = time.monotonic()
    document = assert_problem(*exchange(served, b"GET /healthz HTTP/1.1\r\nHost: t\r\n"), expected=408)
    assert "1 seconds" in str(document["detail"])
    assert time.monotonic() - started < 8


def test_a_body_that_stops_arriving_is_408(served: Served) -> None:
    request = (b"POST /v1/builds HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + BOOTSTRAP_TOKEN.encode() + b"\r\n"
               b"Content-Length: 500\r\n\r\n{\"model\":")
    status, headers, body = exchange(served, request)
    assert_problem(status, headers, body, expected=408)


def test_clients_that_keep_a_closed_connection_open_stall_no_one(served: Served) -> None:
    """A response with "Connection: close" is followed by the server's FIN at once; a client that then
    keeps its socket open (and even sends more) costs the worker nothing while the others are served. gunicorn
    27 lingered on such a socket for 2 s in its event loop, and the worker's every connection waited."""
    holders = []
    try:
        for _ in range(4):  # each would have stalled the (one) worker for 2 s, one after the other
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            holders.append(sock)
        for sock in holders:  # each got its whole answer and the server's FIN, without closing its side
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
            assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"}"), raw[-200:]
            sock.sendall(b"late bytes the server drains")
        started = time.monotonic()
        with requests.Session() as session:
            for _ in range(5):
                assert session.get(f"{served.base}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0
    finally:
        for sock in holders:
            sock.close()


def test_the_server_still_serves_after_all_that(served: Served) -> None:
    assert requests.get(f"{served.base}/healthz", timeout=5).status_code == 200


def test_forwarded_for_is_believed_from_trusted_peers_only(tmp_path: Path) -> None:
    with compilesvc_serve(tmp_path, ["--forwarded-allow-ips", "10.9.9.9"], workers=1) as untrusting:
        requests.get(f"{untrusting.base}/healthz", headers={"X-Forwarded-For": "203.0.113.7"}, timeout=5)
        log = untrusting.log
    with compilesvc_serve(tmp_path, workers=1) as trusting:  # default: 127.0.0.1 is the proxy
        requests.get(f"{trusting.base}/healthz", headers={"X-Forwarded-For": "203.0.113.8"}, timeout=5)
        trusted_log = trusting.log
    clients = [json.loads(line).get("client") for line in log.read_text().splitlines()
               if line.startswith("{") and '"path":"/healthz"' in line]
    assert clients and set(clients) == {"127.0.0.1"}
    clients = [json.loads(line).get("client") for line in trusted_log.read_text().splitlines()
               if line.startswith("{") and '"path":"/healthz"' in line]
    assert clients[-1] == "203.0.113.8"  # the ones before are the fixture's readiness probes
