"""Placeholder secrets ('change-me…', compose's defaults) are refused at start unless
COMPILESVC_ALLOW_PLACEHOLDER_SECRETS says this is a development stack: in Settings, and by the real
``compilesvc serve`` (one line, exit 2)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from compilesvc.config.settings import Settings
from tests.cli.test_main import CLI, clean_env

CASES = {
    "COMPILESVC_SECRET_KEY": "change-me-secret-key",
    "COMPILESVC_BROKER_URL": "redis://:change-me-redis@redis:6379/0",
    "COMPILESVC_DATABASE_URL": "postgresql+psycopg://compilesvc:CHANGEME@postgres:5432/compilesvc",
    "COMPILESVC_BOOTSTRAP_TOKEN": "csvc_change-me-to-a-real-bootstrap-token",
    "COMPILESVC_WEBHOOK_SECRET": "change_me",
    "PGPASSWORD": "change-me-postgres",
    "AWS_SECRET_ACCESS_KEY": "change-me-s3-secret-key",
}


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in (*CASES, "COMPILESVC_ALLOW_PLACEHOLDER_SECRETS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMPILESVC_DATA_DIR", str(tmp_path))
    return monkeypatch


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_placeholder_is_refused_by_name(clean: pytest.MonkeyPatch, name: str) -> None:
    clean.setenv(name, CASES[name])
    with pytest.raises(ValidationError) as refused:
        Settings(_env_file=None)
    message = str(refused.value)
    assert name in message and "COMPILESVC_ALLOW_PLACEHOLDER_SECRETS" in message
    assert CASES[name] not in message  # the refusal names the setting, never prints the secret


def test_the_development_flag_allows_them(clean: pytest.MonkeyPatch) -> None:
    for name, value in CASES.items():
        clean.setenv(name, value)
    clean.setenv("COMPILESVC_ALLOW_PLACEHOLDER_SECRETS", "true")
    assert Settings(_env_file=None).allow_placeholder_secrets


def test_real_secrets_and_no_secrets_start(clean: pytest.MonkeyPatch) -> None:
    assert not Settings(_env_file=None).allow_placeholder_secrets  # the embedded default: nothing to refuse
    clean.setenv("COMPILESVC_SECRET_KEY", "3f9c0e-a-real-random-key")
    clean.setenv("COMPILESVC_BROKER_URL", "redis://:s3cr3tpassw0rd@redis:6379/0")
    clean.setenv("PGPASSWORD", "another-real-one")
    Settings(_env_file=None)


def test_serve_refuses_to_start_with_a_placeholder(tmp_path: Path) -> None:
    env = clean_env(tmp_path, COMPILESVC_SECRET_KEY="change-me-secret-key")
    done = subprocess.run([str(CLI), "serve", "--port", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "COMPILESVC_SECRET_KEY still holds a placeholder" in done.stderr
    assert "change-me-secret-key" not in done.stderr
