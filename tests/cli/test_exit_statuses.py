"""The exit-status contract of docs/ci.md, command by command: every command that talks to the API, run as
the CLI runs it against one live API for the module (SQLite ledger, local store) or a closed port, for each
failure a pipeline meets: the API unreachable (3), a bad token or one without the scope (2), no such
build, key or policy (2), a request the API refuses (2), an API URL without a scheme (2). ``fetch`` keeps
its fleet statuses (docs/fleet.md): a key not published and an unreachable API are 1 there.

Then ``submit --wait`` against an API that goes away: it exits 3 after ``--outage-tolerance``, not at its
``--timeout``, with one warning, not one per poll; and the first retry of an unreachable API says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from werkzeug.serving import BaseWSGIServer, make_server

from compilesvc.cli.main import main
from compilesvc.client.api import RETRY_BUDGET_SECONDS
from compilesvc.services import Services
from tests.fixtures.settings import make_settings
from tests.fixtures.tokens import make_token
from tests.web.support import spec_for
from web.server.app import create_app

MISSING = "0" * 64


@dataclass
class Live:
    base: str
    services: Services
    tokens: dict[str, str]
    files: Path

    def write_spec(self, name: str, uri: str, **fields: object) -> str:
        path = self.files / name
        path.write_text(json.dumps({**spec_for(uri), **fields}))
        return str(path)


def _serve(services: Services) -> tuple[BaseWSGIServer, threading.Thread, str]:
    app = create_app(services=services)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_port}"


def _stop(server: BaseWSGIServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("exit-statuses")
    shutil.copyfile(sqlite_template, root / "ledger.db")
    services = Services.from_settings(make_settings(root, f"sqlite:///{root / 'ledger.db'}"))
    server, thread, base = _serve(services)
    tokens = {scope: make_token(services.sessions, scope, owner=f"exits-{scope}")
              for scope in ("admin", "submit", "read", "fleet")}
    files = root / "files"
    files.mkdir()
    (files / "model.pt").write_bytes(b"exit statuses model")
    try:
        yield Live(base, services, tokens, files)
    finally:
        _stop(server, thread)
        services.close()


@pytest.fixture(scope="module")
def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def run_cli(argv: list[str], *, api: str, token: str, cache: Path) -> tuple[int, str]:
    env = {"COMPILESVC_API_URL": api, "COMPILESVC_TOKEN": token, "COMPILESVC_CONFIG": "/nonexistent/config.toml",
           "COMPILESVC_CACHE_DIR": str(cache), "COMPILESVC_TRUSTED_KEYS": ""}
    result = CliRunner().invoke(main, argv, env=env)
    return result.exit_code, result.stderr


def no_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's retries of an unreachable API, all of them, without the 15.5 s of sleeps between them."""
    monkeypatch.setattr("compilesvc.client.api.time", SimpleNamespace(sleep=lambda seconds: None,
                                                                       monotonic=time.monotonic))


#: The commands that talk to the API, each as (argv, its usual scope) with placeholders the test fills in:
#: {model} a file, {spec} a spec of an uploaded model, {missing} an id or key nobody has.
COMMANDS: dict[str, tuple[list[str], str]] = {
    "upload": (["upload", "{model}"], "submit"),
    "submit": (["submit", "{spec}", "--no-wait"], "submit"),
    "status": (["status", "{missing_id}"], "read"),
    "logs": (["logs", "{missing_id}"], "read"),
    "cancel": (["cancel", "{missing_id}"], "submit"),
    "retry": (["retry", "{missing_id}"], "submit"),
    "builds": (["builds"], "read"),
    "campaigns": (["campaigns", "{missing_id}"], "admin"),
    "rollforward": (["rollforward", "--from-sdk", "2.13.0", "--to-sdk", "2.13.0", "--dry-run"], "admin"),
    "rollforward-policies": (["rollforward-policies", "remove", "nosuch"], "admin"),
    "pins": (["pins", "remove", "{missing_id}"], "admin"),
    "tokens": (["tokens", "list"], "admin"),
    "fetch": (["fetch", MISSING], "fleet"),
}

#: A token that may do none of it: (the command's scope) -> a scope below it.
WEAKER = {"submit": "read", "read": "fleet", "admin": "submit", "fleet": "read"}

#: A request each command sends that the API refuses (400, 422), where the command line lets one through.
BAD_INPUT: dict[str, list[str]] = {
    "submit": ["submit", "{spec}", "--no-wait"],  # a blob that was never uploaded: 422
    "builds": ["builds", "--state", "bogus"],  # 400
    "rollforward": ["rollforward", "--from-sdk", "2.13.0", "--to-sdk", "bogus", "--dry-run"],  # 422
    "rollforward-policies": ["rollforward-policies", "add", "p1", "--target", "inf2", "--from-sdk", "bogus"],
    "pins": ["pins", "add", "--artifact", "not-a-key"],
    "tokens": ["tokens", "create", "--name", "n" * 101, "--owner", "o", "--scope", "read"],  # 422: name too long
}

#: Commands whose "not found" is their own documented status: fetch's not-published is 1 (docs/fleet.md).
NOT_FOUND_EXIT = {"fetch": 1}
#: fetch's unreachable API is 1 too (docs/fleet.md: 3 is an artifact that is not trusted).
UNREACHABLE_EXIT = {"fetch": 1}


def argv_for(live: Live, template: list[str]) -> list[str]:
    values = {"model": str(live.files / "model.pt"), "missing_id": "999999",
              "spec": live.write_spec("spec.json", f"blob:sha256:{MISSING}"),
              "bad_spec": live.write_spec("bad.json", f"blob:sha256:{MISSING}", sdk="9.9.9")}
    return [part.format(**values) for part in template]


CASES = [
    *[pytest.param(name, "unreachable", id=f"{name}-unreachable") for name in COMMANDS],
    *[pytest.param(name, "bad-token", id=f"{name}-bad-token") for name in COMMANDS],
    # Every scope may read artifacts (fleet included): fetch has no wrong scope.
    *[pytest.param(name, "wrong-scope", id=f"{name}-wrong-scope") for name in COMMANDS if name != "fetch"],
    *[pytest.param(name, "no-scheme", id=f"{name}-no-scheme") for name in COMMANDS],
    *[pytest.param(name, "not-found", id=f"{name}-not-found") for name in COMMANDS
      if name not in ("upload", "builds", "rollforward", "tokens")],
    *[pytest.param(name, "bad-input", id=f"{name}-bad-input") for name in BAD_INPUT],
]


@pytest.mark.parametrize(("command", "failure"), CASES)
def test_every_command_exits_as_docs_ci_says(live: Live, closed_port: str, tmp_path: Path, command: str,
                                             failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    template, scope = COMMANDS[command]
    api, token, expected = live.base, live.tokens[scope], 2
    if failure == "unreachable":
        no_sleeps(monkeypatch)
        api, expected = closed_port, UNREACHABLE_EXIT.get(command, 3)
    elif failure == "bad-token":
        token = "csvc_not-a-token-of-this-service-0123456789"
    elif failure == "wrong-scope":
        token = live.tokens[WEAKER[scope]]
    elif failure == "no-scheme":
        api = live.base.removeprefix("http://")
    elif failure == "not-found":
        expected = NOT_FOUND_EXIT.get(command, 2)
    else:
        template = BAD_INPUT[command]
    code, stderr = run_cli(argv_for(live, template), api=api, token=token, cache=tmp_path / "cache")
    assert code == expected, stderr
    error_lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "Traceback" not in stderr, stderr
    if failure == "no-scheme":
        assert "http:// or https://" in error_lines[0]
    if failure == "bad-input":  # refused by the API, not by the command line
        assert re.search(r"HTTP 4\d\d", error_lines[0]), error_lines[0]


def test_the_first_retry_of_an_unreachable_api_is_said_once(closed_port: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    no_sleeps(monkeypatch)
    code, stderr = run_cli(["builds"], api=closed_port, token="csvc_x", cache=tmp_path)
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert code == 3
    assert len(warnings) == 1 and f"retrying for up to {RETRY_BUDGET_SECONDS:g} s" in warnings[0], stderr
    ci = (Path(__file__).resolve().parents[2] / "docs" / "ci.md").read_text()
    assert f"{RETRY_BUDGET_SECONDS:g} s in all" in ci  # the budget docs/ci.md promises is the client's


def test_submit_gives_up_on_an_outage_after_its_tolerance(live: Live, sqlite_template: Path,
                                                         tmp_path: Path) -> None:
    shutil.copyfile(sqlite_template, tmp_path / "ledger.db")
    services = Services.from_settings(make_settings(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}"))
    server, thread, base = _serve(services)
    try:
        token = make_token(services.sessions, "submit", owner="outage")
        upload = subprocess.run([sys.executable, "-m", "compilesvc", "upload", str(live.files / "model.pt")],
                                env={**os.environ, "COMPILESVC_API_URL": base, "COMPILESVC_TOKEN": token,
                                     "COMPILESVC_CONFIG": "/nonexistent"}, capture_output=True, text=True,
                                timeout=60)
        assert upload.returncode == 0, upload.stderr
        uri = upload.stdout.strip()
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(spec_for(uri)))
        env = {**os.environ, "COMPILESVC_API_URL": base, "COMPILESVC_TOKEN": token,
               "COMPILESVC_CONFIG": "/nonexistent", "COMPILESVC_OUTAGE_TOLERANCE": "1"}
        process = subprocess.Popen([sys.executable, "-m", "compilesvc", "submit", str(spec), "--poll", "0.2",
                                    "--timeout", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        assert process.stderr is not None
        said = [process.stderr.readline() for _ in range(2)]  # "build N new: …", then its first bucket's line
        assert said[0].startswith("build ") and said[1].startswith("bucket "), said
    finally:
        _stop(server, thread)  # the API goes away while the build is queued
        services.close()
    started = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    waited = time.monotonic() - started
    assert process.returncode == 3, stderr
    assert waited < 10, f"gave up after {waited:.0f} s"  # not after --timeout, nor a retry budget per poll
    waiting = [line for line in stderr.splitlines() if "still waiting" in line]
    assert len(waiting) == 1 and "--outage-tolerance" in waiting[0], stderr
    assert "has not answered for" in stderr and "may still be running" in stderr, stderr
