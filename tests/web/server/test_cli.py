"""``compilesvc serve``: registered through the entry point, and really serving under gunicorn with two
workers (JSON request logs; counters summed over the workers at scrape time)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from bench._proc import children, cpu_of_each
from compilesvc.cli.main import main
from tests.fixtures.serve import compilesvc_serve
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.web.support import spec_for


def test_serve_is_a_compilesvc_command() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--host", "--port", "--workers", "--dev", "--migrate"):
        assert option in result.output


@pytest.mark.slow
def test_serve_under_gunicorn(tmp_path: Path) -> None:
    with compilesvc_serve(tmp_path, workers=2) as served:
        base, log_path = served.base, served.log
        model = tmp_path / "model.pt2"
        model.write_bytes(b"served model")
        upload = subprocess.run([sys.executable, "-m", "compilesvc", "upload", str(model), "--api", base],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN})
        assert upload.returncode == 0, f"{upload.stderr}\n--- serve log\n{log_path.read_text()[-4000:]}"
        uri = upload.stdout.strip()
        assert uri == f"blob:sha256:{hashlib.sha256(b'served model').hexdigest()}"
        for _ in range(6):  # fresh connections: spread over both workers
            response = requests.post(f"{base}/v1/builds", json=spec_for(uri), headers=bearer(BOOTSTRAP_TOKEN),
                                     timeout=10)
            assert response.status_code == 202, response.text
        for _ in range(4):  # whichever worker answers, the counters are the sum over both
            metrics = requests.get(f"{base}/metrics", timeout=10).text
            submits = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                       if s.name == "compilesvc_submits_total"]
            assert submits == [6.0]

    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("logger") == "compilesvc.web.access"]
    assert {line["path"] for line in access} >= {"/healthz", "/v1/models", "/v1/builds", "/metrics"}
    submits = [line for line in access if line["path"] == "/v1/builds"]
    assert all(line["status"] == 202 and "build_id" in line and "duration_ms" in line for line in submits)
    assert any(line.get("logger") == "gunicorn.error" for line in lines), "gunicorn logs as JSON too"


@pytest.mark.slow
@pytest.mark.parametrize("reuse_port", [True, False])
def test_kept_alive_connections_opened_together_reach_every_worker(tmp_path: Path, reuse_port: bool) -> None:
    """With a socket per worker (--reuse-port), the kernel spreads 16 connections opened at once over both
    workers; on one shared socket (the default) it may give them all to one."""
    flag = "--reuse-port" if reuse_port else "--shared-socket"
    with compilesvc_serve(tmp_path, extra_args=[flag], workers=2) as served:
        sessions = [requests.Session() for _ in range(16)]
        workers = children(served.pid)
        before = cpu_of_each(workers)
        for _ in range(40):  # every connection stays open (keep-alive) and is used in turn
            for session in sessions:
                assert session.get(f"{served.base}/v1/artifacts/{'0' * 64}", headers=bearer(BOOTSTRAP_TOKEN),
                                   timeout=10).status_code == 404
        used = {pid: after - then for pid, after, then in zip(workers, cpu_of_each(workers), before, strict=True)}
        for session in sessions:
            session.close()
    assert len(used) == 2, used
    if reuse_port:  # 16 connections hashed over 2 sockets: all on one has a chance of 2 in 65,536
        assert min(used.values()) > 0.1 * max(used.values()), used


def test_reuse_port_needs_a_fixed_port(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--reuse-port"],
                                env={"COMPILESVC_DATA_DIR": str(tmp_path)})
    assert result.exit_code == 2, result.output
    assert "--reuse-port needs a fixed --port" in result.output
