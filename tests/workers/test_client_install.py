"""The client install (`pip install compilesvc`, no `server` extra) does what docs/ci.md and docs/fleet.md say
it does: a CI job and a fleet host run their commands against a real service with none of the server's
packages importable, and a server command says what to install instead of failing obscurely.

The client is run in an interpreter where the server extra's modules cannot be imported (a meta-path finder
refuses them, as a venv without them would), so every import its commands make on their real paths is
checked, not only those of ``--help``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from compilesvc.cli.main import SERVER_PACKAGES
from tests.doubles.compiler_flags import DOUBLE_FLAGS_SETTING
from tests.fixtures.signing import trust_env
from tests.workers.conftest import HLO_MODEL, Cluster

MakeCluster = Callable[..., Cluster]
ROOT = Path(__file__).resolve().parents[2]
#: Distribution name (pyproject) -> the top-level module it installs.
MODULE_OF = {"sqlalchemy": "sqlalchemy", "alembic": "alembic", "psycopg": "psycopg", "boto3": "boto3",
             "celery": "celery", "flask": "flask", "prometheus-client": "prometheus_client", "gunicorn": "gunicorn",
             "http-sfv": "http_sfv", "limits": "limits", "lightkube": "lightkube"}
BLOCKED_CLIENT = f"""
import importlib.abc, sys
class NoServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {sorted(SERVER_PACKAGES)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a client install)", name=name)
        return None
sys.meta_path.insert(0, NoServer())
from compilesvc.cli.main import main
sys.argv[0] = "compilesvc"
main()
"""


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_client_install_declares_no_server_package_and_the_cli_knows_them_all() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client, server = _names(project["dependencies"]), _names(project["optional-dependencies"]["server"])
    assert client == {"pydantic", "pydantic-settings", "click", "pyyaml", "orjson", "cryptography"}
    assert not client & server
    assert {MODULE_OF[name] for name in server} <= SERVER_PACKAGES  # an unknown one would not be named


def test_a_ci_job_and_a_fleet_host_work_from_the_client_install(make_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = make_cluster()
    env = cluster.client_env(cluster.start_service(concurrency=1), tmp_path)
    env.update({"COMPILESVC_CACHE_DIR": str(tmp_path / "cache"), **trust_env(cluster.services),
                # `key` checks flags as the service does: the service here accepts the double's flag.
                "COMPILESVC_EXTRA_COMPILER_FLAGS": DOUBLE_FLAGS_SETTING})

    def client(*args: str) -> subprocess.CompletedProcess[str]:
        run = subprocess.run([sys.executable, "-c", BLOCKED_CLIENT, *args], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=180)
        return run

    model = tmp_path / "model.hlo.pb"
    model.write_bytes(HLO_MODEL)
    uploaded = client("upload", str(model))
    assert uploaded.returncode == 0, uploaded.stderr
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(cluster.hlo_spec("ok", uri=uploaded.stdout.strip())))
    local_key = client("key", str(spec))
    assert local_key.returncode == 0, local_key.stderr
    built = client("submit", str(spec), "--poll", "0.3")
    assert built.returncode == 0, built.stderr
    key = built.stdout.strip()
    assert key == local_key.stdout.strip()
    for args in (("status", "1"), ("logs", "1"), ("builds", "--json")):
        assert client(*args).returncode == 0, args
    fetched = client("fetch", key, "--dest", str(tmp_path / "artifact"))
    assert fetched.returncode == 0, fetched.stderr
    verified = client("verify", str(tmp_path / "artifact"))
    assert verified.returncode == 0, verified.stderr

    # A server command says what to install, in one line, whether its module or its run needs the server.
    for command in (("serve", "--port", "1"), ("worker",), ("relay",), ("migrate",), ("gc", "--dry-run")):
        refused = client(*command)
        assert refused.returncode == 2, (command, refused.stderr)
        assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert refused.stderr.rstrip().endswith("pip install 'compilesvc[server]'"), refused.stderr
    listed = client("--help")
    assert listed.returncode == 0 and "(needs the server install: compilesvc[server])" in listed.stdout
