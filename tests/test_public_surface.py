"""Every import that users, deployments and docs name still works after the tree moved: the packages'
public names, the console script and its ``compilesvc.commands`` entry points, the Celery task name a
queue's messages carry, and each module or attribute README.md and docs/ spell out."""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC = ["compilesvc.spec.CompileSpec", "compilesvc.config.Settings", "compilesvc.fleet.ArtifactSet",
          "compilesvc.dispatch.routing.COMPILE_TASK"]
# Commands users type, each an entry point of the distribution (the names are the public surface).
COMMANDS = {"serve", "worker", "compile-runner", "doctor", "relay", "dev", "submit", "status", "logs", "cancel",
            "retry", "builds", "rollforward", "campaigns", "gc", "pins", "upload", "fetch", "tokens", "verify",
            "sign-artifacts", "neuron-releases", "rollforward-policies", "serve-env"}


def resolve(dotted: str) -> Any:
    """The module or attribute ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def named_in_docs() -> list[str]:
    names = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, imported in re.findall(r"from ((?:compilesvc|web|workers)[\w.]*) import ([\w, ]+)", text):
            names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
        names.update(re.findall(r"`((?:compilesvc|web|workers)\.[\w.]+)`", text))
    return sorted(names - {"compilesvc.commands"} - helm_values())  # the entry-point group, checked below


def helm_values() -> set[str]:
    """``workers.pools`` and its siblings: paths in the Helm chart's values (docs/kubernetes.md), not modules."""
    import yaml

    values = yaml.safe_load((ROOT / "deploy" / "helm" / "compilesvc" / "values.yaml").read_text())

    def paths(prefix: str, node: object) -> set[str]:
        found = {prefix}
        if isinstance(node, dict):
            for key, child in node.items():
                found |= paths(f"{prefix}.{key}", child)
        return found

    return paths("workers", values["workers"]) - {"workers"}


@pytest.mark.parametrize("dotted", PUBLIC + named_in_docs())
def test_a_named_import_resolves(dotted: str) -> None:
    assert resolve(dotted) is not None


@pytest.mark.parametrize("package", ["compilesvc", "compilesvc.fleet"])
def test_every_exported_name_is_there(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__ and all(hasattr(module, name) for name in module.__all__)


def test_the_console_script_and_every_command_load() -> None:
    scripts = {e.name: e for e in metadata.entry_points(group="console_scripts") if e.name == "compilesvc"}
    assert callable(scripts["compilesvc"].load())
    commands = {e.name: e for e in metadata.entry_points(group="compilesvc.commands")}
    assert set(commands) >= COMMANDS, COMMANDS - set(commands)
    for entry in commands.values():
        assert entry.load() is not None, entry.value


def test_the_celery_task_keeps_its_name() -> None:
    # Messages already queued name the task: a rename would strand them on every worker after an upgrade.
    from workers.celery_app import make_app

    app = make_app()
    app.loader.import_default_modules()  # the worker's own start: its include list registers the task
    assert "compilesvc.compile_bucket" in app.tasks
