"""Redirects and the bearer token, against real HTTP servers on two loopback addresses: 127.0.0.1 answers
with a redirect to 127.0.0.2 (another origin), which records whatever reaches it."""

from __future__ import annotations

import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from compilesvc.client.api import DOWNLOADS, Api, RedirectRefused
from compilesvc.fleet._remote import FleetError, Remote
from tests.cli.test_main import CLI, clean_env

TOKEN = "csvc_" + "r" * 43


class Server:
    """An HTTP server on ``host`` recording each request's path and headers. A path starting with
    ``/go/`` answers ``status`` with a Location of ``target`` + the rest of the path; others answer 200."""

    def __init__(self, host: str, target: str = "", status: int = 302):
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.target = target
        self.status = status
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path.startswith("/go/"):
                    self.send_response(server.status)
                    self.send_header("Location", server.target + self.path[len("/go"):])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def other() -> Iterator[Server]:
    """The other origin: 127.0.0.2 (loopback, another host name as far as origins go)."""
    server = Server("127.0.0.2")
    yield server
    server.close()


@pytest.fixture
def redirector(other: Server) -> Iterator[Server]:
    server = Server("127.0.0.1", target=other.url)
    yield server
    server.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_api_refuses_a_redirect_and_sends_nothing_to_its_target(redirector: Server, other: Server,
                                                              status: int) -> None:
    redirector.status = status
    api = Api(redirector.url, token=TOKEN, retries=0)
    with pytest.raises(RedirectRefused) as caught:
        api.request("POST", "/go/v1/builds", {"spec": 1})
    assert caught.value.status == status
    assert f"{other.url}/v1/builds" in caught.value.message
    assert "COMPILESVC_API_URL" in caught.value.message
    assert redirector.seen[0][1]["authorization"] == f"Bearer {TOKEN}"  # the API itself got the token
    assert other.seen == []  # the other origin got nothing at all, the token least of all


def test_api_refuses_a_redirect_within_its_own_origin_too(redirector: Server) -> None:
    redirector.target = redirector.url  # a JSON call is never redirected: even this is a wrong base URL
    with pytest.raises(RedirectRefused):
        Api(redirector.url, token=TOKEN, retries=0).request("GET", "/go/v1/builds")
    assert [path for path, _ in redirector.seen] == ["/go/v1/builds"]


def test_api_still_answers_without_a_redirect(redirector: Server) -> None:
    assert Api(redirector.url, token=TOKEN, retries=0).request("GET", "/v1/builds") == {"ok": True}
    assert redirector.seen[0][1]["authorization"] == f"Bearer {TOKEN}"


def test_cli_reports_a_refused_redirect_in_one_line(redirector: Server, other: Server, tmp_path: Path) -> None:
    env = clean_env(tmp_path, COMPILESVC_API_URL=f"{redirector.url}/go", COMPILESVC_TOKEN=TOKEN)
    done = subprocess.run([str(CLI), "builds"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr  # the build commands' "fix your input" (docs/ci.md)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "follows no redirects" in lines[0], done.stderr
    assert TOKEN not in done.stderr
    assert redirector.seen and other.seen == []


def test_fleet_library_refuses_a_redirect(redirector: Server, other: Server) -> None:
    remote = Remote(Api(f"{redirector.url}/go", token=TOKEN, retries=0))
    with pytest.raises(FleetError, match="follows no redirects"):
        remote.published("0" * 64)
    assert redirector.seen and other.seen == []


def test_download_redirect_to_another_origin_drops_the_credentials(redirector: Server, other: Server) -> None:
    request = urllib.request.Request(f"{redirector.url}/go/blob", headers={
        "Authorization": f"Bearer {TOKEN}", "Cookie": "compilesvc_session=x", "Range": "bytes=0-"})
    with DOWNLOADS.open(request, timeout=10) as response:
        assert response.read() == b'{"ok": true}'
    assert [path for path, _ in other.seen] == ["/blob"]
    headers = other.seen[0][1]
    assert "authorization" not in headers and "cookie" not in headers
    assert headers["range"] == "bytes=0-"  # the rest of the request goes on


def test_download_redirect_within_the_origin_keeps_them(redirector: Server) -> None:
    redirector.target = redirector.url
    request = urllib.request.Request(f"{redirector.url}/go/blob", headers={"Authorization": f"Bearer {TOKEN}"})
    with DOWNLOADS.open(request, timeout=10) as response:
        assert response.status == 200
    assert [path for path, _ in redirector.seen] == ["/go/blob", "/blob"]
    assert redirector.seen[1][1]["authorization"] == f"Bearer {TOKEN}"
