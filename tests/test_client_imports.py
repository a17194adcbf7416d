"""The CI client starts light: its commands load neither the ledger's SQLAlchemy nor boto3, Celery or Flask
(a CI job pays every import at every call). Checked on the commands as a user runs them, in fresh
interpreters, and on the client's modules imported together."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: What the client must never load (the server's libraries and what they bring).
SERVER_ONLY = ("sqlalchemy", "boto3", "botocore", "celery", "kombu", "flask")
#: The client's commands (docs/ci.md, docs/fleet.md): they talk to the API over HTTP, or read a local cache.
CLIENT_COMMANDS = ("submit", "status", "logs", "cancel", "retry", "builds", "upload", "fetch", "verify",
                   "rollforward", "campaigns", "serve-env")
CLIENT_MODULES = ("compilesvc.cli.main", "compilesvc.cli.builds", "compilesvc.cli.campaigns",
                  "compilesvc.cli.connection", "compilesvc.cli.fetch", "compilesvc.cli.serve_env",
                  "compilesvc.cli.verify", "compilesvc.client.follow", "compilesvc.fleet")


def imported_top_level(stderr: str) -> set[str]:
    """The top-level packages ``-X importtime`` says were imported (its lines end with the module's name)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.slow
@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_a_client_command_loads_no_server_library(command: str) -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "compilesvc", command, "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Usage:" in result.stdout
    loaded = imported_top_level(result.stderr)
    assert "compilesvc" in loaded and "click" in loaded  # the probe sees imports at all
    assert loaded.isdisjoint(SERVER_ONLY), sorted(loaded & set(SERVER_ONLY))


@pytest.mark.slow
def test_the_client_modules_load_no_server_library() -> None:
    probe = ("import importlib, sys\n"
             f"for name in {CLIENT_MODULES!r}: importlib.import_module(name)\n"
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(result.stdout.split())
    assert "compilesvc" in loaded and "click" in loaded
    assert loaded.isdisjoint(SERVER_ONLY), sorted(loaded & set(SERVER_ONLY))
