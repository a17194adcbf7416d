"""``compilesvc serve``: registered through the entry point, and really serving under gunicorn with two
workers (JSON request logs; counters summed over the workers at scrape time)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from compilesvc.cli import main
from tests.web.support import spec_for


def test_serve_is_a_compilesvc_command() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--host", "--port", "--workers", "--dev", "--migrate"):
        assert option in result.output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_under_gunicorn(tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "COMPILESVC_DATA_DIR": str(tmp_path / "data"), "COMPILESVC_PUBLIC_URL": base,
           "COMPILESVC_REQUIRE_LIVE_WORKER": "false"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "compilesvc", "serve", "--port", str(port), "--workers", "2",
                                 "--migrate"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if requests.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or too slow to answer on a loaded host
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)

        model = tmp_path / "model.pt2"
        model.write_bytes(b"served model")
        upload = subprocess.run([sys.executable, "-m", "compilesvc", "upload", str(model), "--api", base],
                                capture_output=True, text=True, timeout=60)
        assert upload.returncode == 0, f"{upload.stderr}\n--- serve log\n{log_path.read_text()[-4000:]}"
        uri = upload.stdout.strip()
        assert uri == f"blob:sha256:{hashlib.sha256(b'served model').hexdigest()}"
        for _ in range(6):  # fresh connections: spread over both workers
            response = requests.post(f"{base}/v1/builds", json=spec_for(uri), timeout=10)
            assert response.status_code == 202, response.text
        for _ in range(4):  # whichever worker answers, the counters are the sum over both
            metrics = requests.get(f"{base}/metrics", timeout=10).text
            submits = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                       if s.name == "compilesvc_submits_total"]
            assert submits == [6.0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)

    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("logger") == "compilesvc.web.access"]
    assert {line["path"] for line in access} >= {"/healthz", "/v1/models", "/v1/builds", "/metrics"}
    submits = [line for line in access if line["path"] == "/v1/builds"]
    assert all(line["status"] == 202 and "build_id" in line and "duration_ms" in line for line in submits)
    assert any(line.get("logger") == "gunicorn.error" for line in lines), "gunicorn logs as JSON too"
