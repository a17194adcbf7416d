"""/openapi.json through validators the project did not write (issue 27, finding 8): openapi-spec-validator
(the OpenAPI 3.1 schema and its rules) and Spectral's ``spectral:oas`` ruleset, with zero errors and only
the warnings listed in ``KEPT_WARNINGS``, each with why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate

from tests.web.node_tools import node_tool
from tests.web.support import Env
from web.contract.openapi import operation

#: Spectral warnings we keep: (rule, path prefix) -> why. Any other warning fails the test.
KEPT_WARNINGS: dict[tuple[str, str], str] = {
    ("info-contact", "info"): "whom to ask is each deployment's operators, and no setting names them (the "
                              "project has no public home either); a made-up contact would send people astray",
}


def document(env: Env) -> dict[str, Any]:
    answer = env.client.get("/openapi.json")
    assert answer.status_code == 200
    return answer.json  # type: ignore[no-any-return]


def test_openapi_spec_validator_finds_nothing(sqlite_env: Env) -> None:
    validate(document(sqlite_env))  # raises on the first error


def test_the_document_declares_its_servers_tags_and_describes_every_operation(sqlite_env: Env) -> None:
    spec = document(sqlite_env)
    assert [s["url"] for s in spec["servers"]] == [sqlite_env.services.settings.public_url.rstrip("/")]
    declared = {tag["name"]: tag.get("description") for tag in spec["tags"]}
    assert all(declared.values()), declared
    for path, item in spec["paths"].items():
        for method, op in item.items():
            assert set(op["tags"]) <= set(declared), (method, path, op["tags"])
            assert op.get("description"), (method, path)
    used = {tag for item in spec["paths"].values() for op in item.values() for tag in op["tags"]}
    assert used == set(declared)  # no tag declared for nothing


def test_spectral_oas_finds_no_error_and_only_the_kept_warnings(sqlite_env: Env, tmp_path: Path) -> None:
    spectral = node_tool(".bin/spectral")
    (tmp_path / "openapi.json").write_text(json.dumps(document(sqlite_env)))
    (tmp_path / ".spectral.yaml").write_text('extends: ["spectral:oas"]\n')
    run = subprocess.run([str(spectral), "lint", "--format", "json", "--quiet", "--ruleset",
                          str(tmp_path / ".spectral.yaml"), str(tmp_path / "openapi.json")],
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip(), f"spectral said nothing (exit {run.returncode}): {run.stderr[-2000:]}"
    findings = json.loads(run.stdout)
    # Severity 0 is an error, 1 a warning; 2 (information) and 3 (hint) are not counted.
    errors = [f for f in findings if f["severity"] == 0]
    warnings = [f for f in findings if f["severity"] == 1 and not _kept(f)]
    assert not errors and not warnings, "\n".join(
        f"{f['code']} at {'.'.join(map(str, f['path']))}: {f['message']}" for f in errors + warnings)


def _kept(finding: dict[str, Any]) -> bool:
    where = ".".join(map(str, finding["path"]))
    return any(finding["code"] == rule and where.startswith(prefix) for rule, prefix in KEPT_WARNINGS)



def test_an_operation_with_an_undeclared_tag_or_no_description_is_refused_at_declaration() -> None:
    with pytest.raises(ValueError, match="tag 'nope' is not one of"):
        operation(summary="s", tag="nope", description="d")
    with pytest.raises(ValueError, match="no description"):
        operation(summary="s", tag="builds", description="")
