"""``compilesvc dev --demo``: the README's first command, end to end with no external service (SQLite
ledger, local artifact directory, kombu's filesystem broker, real API/worker/relay processes, the real
torchscript compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from compilesvc.artifacts import read_manifest
from compilesvc.config import Settings
from compilesvc.ledger.models import Artifact, Build
from compilesvc.store import open_store
from tests.fixtures.ports import free_port

COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))



@pytest.mark.slow
def test_dev_demo_builds_the_bundled_model(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}
    proc = subprocess.run([COMPILESVC, "dev", "--demo", "--exit-after-demo", "--port", str(free_port()),
                           "--data-dir", str(data_dir)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "succeeded in" in proc.stdout and "/logs" in proc.stdout, proc.stdout

    settings = Settings(data_dir=data_dir)
    engine = create_engine(settings.resolved_database_url)
    try:
        with Session(engine) as session:
            build = session.scalars(select(Build)).one()
            artifact = session.scalars(select(Artifact)).one()
    finally:
        engine.dispose()
    assert (build.state, build.submitted_by, artifact.state) == ("succeeded", "compilesvc dev --demo", "published")
    manifest = read_manifest(open_store(settings), artifact.key)
    assert manifest is not None and len(manifest.buckets) == 3
    assert all(entry.files and entry.log for entry in manifest.buckets)
