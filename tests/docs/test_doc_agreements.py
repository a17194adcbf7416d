"""Docs that must say what the code and the deployment files do (issue 44's disagreements): the quick start of
docs/deploy.md runs every setup step docker-compose.yml's header names; docs/security.md gives the secret key
to exactly the compose services that hold it; README's requirements for `make dev` name bubblewrap while the
default sandbox is bubblewrap."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from compilesvc.config.settings import Settings
from tests.fixtures.docs import doc_block

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_start_makes_everything_compose_mounts() -> None:
    header = [line[1:].strip() for line in (ROOT / "docker-compose.yml").read_text().splitlines()
              if line.startswith("#")]
    # The header's setup commands: a copy of the env file and the repository's scripts (docker/…).
    steps = [re.split(r"\s{2,}#", line)[0].strip() for line in header if line.startswith(("cp ", "docker/"))]
    assert "docker/make-signing-key" in steps
    quick_start = doc_block("deploy.md", "## Quick start")
    for step in steps:
        assert step in quick_start, f"docs/deploy.md's quick start never runs {step!r}"


def test_security_md_names_every_service_holding_the_secret_key() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    holders = sorted(name for name, service in compose["services"].items()
                     if "COMPILESVC_SECRET_KEY" in (service.get("environment") or {}))
    assert holders == ["api", "relay"]
    row = next(line for line in (ROOT / "docs" / "security.md").read_text().splitlines()
               if line.startswith("| a service → more than it needs"))
    said = re.search(r"the secret key \([^)]*\) on ([^,]*)", row)
    assert said is not None, row
    assert said[1] == "the API and the relay only", said[1]


def test_readme_names_bubblewrap_for_make_dev() -> None:
    assert Settings.model_fields["sandbox"].default == "bwrap"  # the sandbox a `make dev` worker runs compiles in
    readme = (ROOT / "README.md").read_text()
    requirements = readme[readme.index("`make dev` needs"):].split("\n\n", 1)[0]
    assert "bubblewrap" in requirements, requirements
