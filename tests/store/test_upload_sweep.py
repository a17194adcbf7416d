"""The relay process sweeps abandoned uploads: ``compilesvc relay --once`` as a real subprocess.

The store's own sweep is covered by the conformance suite (tests/store); this checks that the relay
calls it with ``COMPILESVC_ABANDONED_UPLOAD_SECONDS`` and survives a store it cannot reach.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from compilesvc.ledger.migrate import upgrade
from compilesvc.store import LocalStore


def relay_once(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env.update({"COMPILESVC_DATA_DIR": str(tmp_path / "data"), **settings})
    result = subprocess.run([sys.executable, "-m", "compilesvc", "relay", "--once"], env=env,
                            capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return result, lines


def migrated(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(exist_ok=True)
    upgrade(f"sqlite:///{tmp_path / 'data' / 'compilesvc.db'}")


def test_relay_removes_abandoned_temp_files(tmp_path: Path) -> None:
    migrated(tmp_path)
    root = tmp_path / "store"
    LocalStore(root, public_url="http://x", secret_key=b"k" * 32)
    abandoned, live = root / "tmp" / "w-abandoned", root / "tmp" / "w-live"
    abandoned.write_bytes(b"left by an API killed mid-upload")
    live.write_bytes(b"an upload still arriving")
    two_hours_ago = time.time() - 7200  # past the setting, but not the 24 h a store checks when opened
    os.utime(abandoned, (two_hours_ago, two_hours_ago))

    result, lines = relay_once(tmp_path, COMPILESVC_STORE_URL=root.as_uri(), COMPILESVC_ABANDONED_UPLOAD_SECONDS="3600")
    assert result.returncode == 0, result.stderr
    assert not abandoned.exists() and live.exists()
    assert any(line["msg"] == "removed abandoned uploads" and line["removed"] == 1 for line in lines), result.stderr
    # The one format every process logs in (compilesvc.jsonlog), not a relay-specific one.
    assert all(line["service"] == "relay" and line["ts"].endswith("Z") for line in lines), result.stderr


def test_relay_survives_an_unreachable_store(tmp_path: Path) -> None:
    migrated(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    result, lines = relay_once(
        tmp_path, COMPILESVC_STORE_URL="s3://nowhere/prefix", COMPILESVC_S3_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}",
        AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_MAX_ATTEMPTS="1",
    )
    assert result.returncode == 0, result.stderr
    assert any(line["msg"] == "upload sweep failed" and "unavailable" in str(line["error"]) for line in lines), \
        result.stderr
