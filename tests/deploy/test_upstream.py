"""`.ci/test_upstream.py` (`make test-upstream`): its arguments and its plan, never a real run (that takes a
full install and the fault suite once per package; it is run by hand, not in CI)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "test_upstream.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_upstream_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


upstream = _load()


def _plan(argv: list[str], tmp_path: Path) -> list[tuple[str, list[str]]]:
    args = upstream.parse_args(argv)
    return [(name, [" ".join(step.argv) for step in steps]) for name, steps in upstream.plan(args, tmp_path)]


def test_default_packages_are_the_broker_then_the_ledger_then_the_store(tmp_path: Path) -> None:
    groups = _plan([], tmp_path)
    assert [name for name, _ in groups] == ["", "(lock)", "celery", "kombu", "redis", "sqlalchemy", "psycopg", "boto3"]
    base = groups[0][1]
    # The base is what `make install` makes: the lock hash-checked, dev constrained by it, the project alone.
    assert any(f"--require-hashes -r {upstream.LOCK}" in step for step in base)
    assert any(f"-c {tmp_path}/lock-constraints.txt -r {tmp_path}/dev-requirements.txt" in step for step in base)
    assert base[-1].endswith(f"--no-deps -e {ROOT}")
    for name, steps in groups[2:]:
        assert steps[0].endswith(f"-m venv {tmp_path / name}")
        assert "--upgrade --upgrade-strategy only-if-needed" in steps[1] and steps[1].endswith(f" {name}")
        assert f"{tmp_path / name}/bin/python -m pytest -m faults tests/faults" in steps[2]


def test_packages_base_baseline_and_extra_pytest_arguments(tmp_path: Path) -> None:
    base = tmp_path / "venv"
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python").touch()
    groups = _plan(["--packages", "Kombu,redis", "--base", str(base), "--no-baseline", "--", "-k", "broker"],
                   tmp_path)
    assert [name for name, _ in groups] == ["kombu", "redis"]  # no base to build, no row of the lock alone
    assert groups[0][1][-1].endswith(f"-m faults tests/faults -p no:cacheprovider -q -k broker "
                                     f"--junitxml={tmp_path}/kombu.xml")


@pytest.mark.parametrize(("argv", "message"), [
    (["--packages", "celery,nope"], "not in requirements/server.lock: nope"),
    (["--packages", "celery,Celery"], "a package named twice"),
    (["--packages", ","], "no package named"),
    (["--base", "/nonexistent-venv"], "no bin/python there"),
])
def test_refuses_what_it_cannot_run(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        upstream.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_locked_versions_are_the_lock_pins() -> None:
    locked = upstream.locked_versions()
    assert locked["torch"] == "2.13.0+cpu"
    assert set(upstream.DEFAULT_PACKAGES) <= locked.keys()
    constraints = upstream.lock_constraints().splitlines()
    assert "celery==" + locked["celery"] in constraints and not any("--hash" in line for line in constraints)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--packages", "celery"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=True)
    assert "== celery (locked " in done.stdout and "-m pytest -m faults" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_table_names_what_broke() -> None:
    rows = [upstream.Row("celery", "5.7.0", "5.7.1", ["kombu==5.7.1"], "FAILED (1)",
                         ["test_broker_loss::test_redis_restart"], 61.0),
            upstream.Row("redis", "8.1.0", "8.1.0", [], "newest is the lock's: not run")]
    text = upstream.table(rows)
    assert "| celery | 5.7.0 | 5.7.1 | kombu==5.7.1 | FAILED (1) | test_broker_loss::test_redis_restart | 61 |" in text
    assert "| redis | 8.1.0 | 8.1.0 | - | newest is the lock's: not run | - | 0 |" in text
