"""``compilesvc dev --demo``: the README's first command, end to end with no external service (SQLite
ledger, local artifact directory, kombu's filesystem broker, real API/worker/relay processes, the real
torchscript compiler)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import authenticate, list_tokens, revoke
from compilesvc.cli.dev import ADMIN_TOKEN_FILE, admin_token, worker_summary
from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import make_engine, make_sessionmaker, transaction
from compilesvc.ledger.migrate import upgrade
from compilesvc.ledger.models import Artifact, Build
from compilesvc.lifecycle.artifacts import read_manifest
from compilesvc.signing.artifacts import verify_artifact
from compilesvc.signing.keys import GENERATED_KEY_NAME, TRUSTED_KEYS_ENV, SigningKey, TrustedKeys, public_key_path
from compilesvc.store import open_store
from compilesvc.store.base import artifact_signature_name
from tests.fixtures.ports import free_port
from workers.host.capabilities import detect_capabilities

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
    printed = re.search(r"^admin token \(new\): (csvc_\S+)$", proc.stdout, re.M)
    assert printed is not None, proc.stdout
    token_file = data_dir / ADMIN_TOKEN_FILE
    assert token_file.read_text().strip() == printed[1] and token_file.stat().st_mode & 0o777 == 0o600
    assert "/login" in proc.stdout and "COMPILESVC_TOKEN" in proc.stdout

    settings = Settings(data_dir=data_dir)
    engine = create_engine(settings.resolved_database_url)
    try:
        with Session(engine) as session:
            build = session.scalars(select(Build)).one()
            artifact = session.scalars(select(Artifact)).one()
    finally:
        engine.dispose()
    assert (build.state, build.submitted_by, artifact.state) == ("succeeded", "dev", "published")
    manifest = read_manifest(open_store(settings), artifact.key)
    assert manifest is not None and len(manifest.buckets) == 3
    assert all(entry.files and entry.log for entry in manifest.buckets)
    # Signed by the key generated in the data dir (0600), which the launcher told how to trust.
    key_file = data_dir / GENERATED_KEY_NAME
    assert key_file.stat().st_mode & 0o777 == 0o600
    public = public_key_path(key_file)
    assert f"export {TRUSTED_KEYS_ENV}={public}" in proc.stdout
    bundle = open_store(settings).read_document(artifact_signature_name(artifact.key))
    assert bundle is not None
    verified = verify_artifact(TrustedKeys.from_paths([public]), bundle, manifest)
    assert verified.key_id == SigningKey.load(key_file).key_id and verified.key_id in proc.stdout


def test_the_admin_token_is_made_once_and_replaced_when_it_stops_working(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    settings.data_dir.mkdir()
    upgrade(settings.resolved_database_url)
    first, new = admin_token(settings)
    assert new and (settings.data_dir / ADMIN_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert admin_token(settings) == (first, False)  # every later start prints the same token
    engine = make_engine(settings.resolved_database_url)
    try:
        sessions = make_sessionmaker(engine)
        with transaction(sessions) as session:
            principal = authenticate(session, first)
            assert principal is not None and principal.is_admin
            revoke(session, principal.token_id)
        second, new = admin_token(settings)
        assert new and second != first
        with sessions() as session:
            assert len(list_tokens(session)) == 1  # the revoked one is not listed
    finally:
        engine.dispose()


@pytest.mark.slow
def test_a_second_dev_is_refused_before_it_starts_anything(tmp_path: Path) -> None:
    # Seen: a second `make dev` reported the first one's demo as its own, then died on "Address already in use".
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}
    port = free_port()
    first = subprocess.Popen([COMPILESVC, "dev", "--port", str(port), "--data-dir", str(tmp_path / "one")], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if line.startswith("compilesvc is up"):
                break
        else:
            pytest.fail(f"the first dev did not start (exit {first.wait()})")

        def second(data_dir: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run([COMPILESVC, "dev", "--demo", "--exit-after-demo", "--port", str(port),
                                   "--data-dir", str(data_dir)], env=env, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=60)

        same_dir = second(tmp_path / "one")
        assert same_dir.returncode == 1, same_dir.stdout + same_dir.stderr
        assert f"another compilesvc dev (pid {first.pid}) runs on {tmp_path / 'one'}" in same_dir.stderr
        assert "demo" not in same_dir.stdout
        same_port = second(tmp_path / "two")
        assert same_port.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in same_port.stderr
        assert first.poll() is None  # the first one is untouched
    finally:
        first.terminate()
        first.wait(60)



def test_dev_says_what_its_worker_compiles_for_and_how_to_get_neuron() -> None:
    assert worker_summary([]) is None  # not registered yet: nothing to say
    caps = detect_capabilities()  # this host's, as its worker registers them
    if caps["neuron"] and caps["neuron"]["kinds"]:
        pytest.skip("this host has a Neuron SDK configured")
    assert worker_summary([{"capabilities": caps}]) == (
        f"worker compiles for: cpu (torch {caps['sdk']['cpu']}); no Neuron target: start dev in the Neuron SDK's "
        "environment with COMPILESVC_NEURON_SDK set (docs/llm.md, 'Trying it locally')")
    # Set, with no SDK behind it: the SDK is what is missing, not the setting.
    said = worker_summary([{"capabilities": caps}], "2.27.1")
    assert said is not None and "COMPILESVC_NEURON_SDK is 2.27.1, but the worker found no Neuron SDK" in said
    assert "with COMPILESVC_NEURON_SDK set" not in said
