"""The import rules of docs/architecture.md hold (``lint-imports``, the contracts in pyproject.toml), and they
are not decoration: the same contracts on a copy of the tree with one wrong import break."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy's packages, not the installed ones: lint-imports reads the modules it can import.
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def test_the_tree_keeps_every_contract() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_wrong_import_breaks_the_contracts(tmp_path: Path) -> None:
    for package in ("compilesvc", "web", "workers"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    keys = tmp_path / "compilesvc" / "spec" / "keys.py"
    keys.write_text(keys.read_text() + "\nfrom compilesvc.ledger import models  # noqa: E402\n")
    api = tmp_path / "compilesvc" / "client" / "api.py"
    api.write_text(api.read_text() + "\nimport flask  # noqa: E402\n")
    problems = tmp_path / "web" / "contract" / "problems.py"
    problems.write_text(problems.read_text() + "\nfrom web import auth  # noqa: E402\n")
    sandbox = tmp_path / "workers" / "isolation" / "sandbox.py"
    sandbox.write_text(sandbox.read_text() + "\nfrom workers.compiling import runner  # noqa: E402\n")
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "compilesvc.spec is not allowed to import compilesvc.ledger" in result.stdout
    assert "compilesvc.client is not allowed to import flask" in result.stdout
    assert "web.contract is not allowed to import web.auth" in result.stdout
    assert "workers.isolation is not allowed to import workers.compiling" in result.stdout


def drawn_layers(text: str, after: str) -> list[str]:
    """The first diagram after the words ``after`` in docs/architecture.md, one layer a line."""
    diagram = text.split(after, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [line.strip().split("  ", 1)[0].strip() for line in diagram.splitlines() if line.strip()]


def test_the_architecture_diagrams_are_the_layers_contracts() -> None:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = {c["layers"][0].split(".", 1)[0]: c["layers"] for c in contracts if c["type"] == "layers"}
    assert sorted(layered) == ["compilesvc", "web", "workers"]
    text = (ROOT / "docs" / "architecture.md").read_text()
    for root, heading in (("compilesvc", "## The core's layers"), ("web", "**`web/`: the Flask API and the UI.**"),
                          ("workers", "**`workers/`: Celery workers.**")):
        assert drawn_layers(text, heading) == [layer.replace(f"{root}.", "") for layer in layered[root]], root
