"""The compile runner refuses what the EKS pod-identity webhook injects into a container it does not skip:
the variables (AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE, AWS_CONTAINER_CREDENTIALS_FULL_URI …) and the token
file at the webhook's mount paths (aws/amazon-eks-pod-identity-webhook, pkg/handler/handler.go NewModifier and
addEnvToContainer; main.go's container-credentials flags), naming the fix: the skip-containers annotation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from workers.isolation import compile_runner


def test_the_webhook_token_paths_are_the_webhook_s() -> None:
    assert [str(p) for p in compile_runner.TOKEN_FILES] == [
        "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",  # handler.go: MountPath + tokenName "token"
        "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount/eks-pod-identity-token",  # main.go:88,90
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["irsa", "pod-identity"])
def test_a_mounted_token_file_is_refused_naming_the_annotation(
        which: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The webhook's paths under a temporary root (never the host's /var/run).
    tokens = tuple(tmp_path / str(p).lstrip("/") for p in compile_runner.TOKEN_FILES)
    tokens[which].parent.mkdir(parents=True)
    tokens[which].write_text("eyJhbGciOi.secret-token-value")
    monkeypatch.setattr(compile_runner, "TOKEN_FILES", tokens)
    for name in [n for n in os.environ if n.startswith(("AWS_", "COMPILESVC_", "PG"))]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(compile_runner, "serve", lambda *_: pytest.fail("served with a token mounted"))
    result = CliRunner().invoke(compile_runner.compile_runner, ["--spool", str(tmp_path / "spool")])
    assert result.exit_code == 78
    assert str(tokens[which]) in result.output and "eks.amazonaws.com/skip-containers" in result.output
    assert "secret-token-value" not in result.output
    assert compile_runner.mounted_credentials(tokens) == [str(tokens[which])]
    assert compile_runner.mounted_credentials((tmp_path / "absent",)) == []


def test_the_webhook_s_variables_are_refused_naming_the_annotation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_runner, "TOKEN_FILES", ())
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks.amazonaws.com/serviceaccount/token")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::111122223333:role/compilesvc-worker")
    monkeypatch.setattr(compile_runner, "serve", lambda *_: pytest.fail("served with AWS variables"))
    result = CliRunner().invoke(compile_runner.compile_runner, ["--spool", "/nonexistent"])
    assert result.exit_code == 78
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" in result.output and "eks.amazonaws.com/skip-containers" in result.output


def _bwrap(tmp_path: Path, token: Path | None) -> list[str]:
    """The runner as a real process, the webhook's token (if any) bound read-only at its path under a fresh
    /run (never written to the host's /var/run), the rest of the host as it is."""
    # /var/run is a link to /run (_bwrap_works checks), which bwrap will not follow for a bind's target.
    bind = [] if token is None else ["--ro-bind", str(tmp_path / "token"), str(token).replace("/var/run/", "/run/", 1)]
    return ["bwrap", "--dev-bind", "/", "/", "--tmpfs", "/run", *bind, "--",
            sys.executable, "-m", "workers.isolation.compile_runner", "--spool", str(tmp_path / "spool")]


def _bwrap_works() -> bool:
    if shutil.which("bwrap") is None or Path("/var/run").resolve() != Path("/run"):
        return False
    return subprocess.run(["bwrap", "--dev-bind", "/", "/", "--tmpfs", "/run", "true"],
                          capture_output=True, timeout=30, check=False).returncode == 0


@pytest.mark.skipif(not _bwrap_works(), reason="bubblewrap cannot make a mount namespace here")
@pytest.mark.parametrize("which", [0, 1], ids=["irsa", "pod-identity"])
def test_the_real_runner_refuses_a_token_bound_at_the_webhook_s_path(which: int, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("eyJhbGciOi.secret-token-value")
    (tmp_path / "spool").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "COMPILESVC_", "PG"))}
    done = subprocess.run(_bwrap(tmp_path, compile_runner.TOKEN_FILES[which]), env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 78, done.stderr
    assert str(compile_runner.TOKEN_FILES[which]) in done.stderr and "skip-containers" in done.stderr
    assert "secret-token-value" not in done.stderr + done.stdout
    # The same container skipped by the webhook (no token): the runner starts and beats.
    runner = subprocess.Popen(_bwrap(tmp_path, None), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "spool" / "runner" / "heartbeat").exists():
            assert runner.poll() is None and time.monotonic() < deadline, runner.stderr and runner.stderr.read()
            time.sleep(0.1)
    finally:
        runner.terminate()
        runner.wait(30)
