"""Every fenced block of README.md and docs/*.md, and what runs or checks it.

:data:`BLOCKS` maps each block (file, heading, language, first line) to the test that runs it against a
real stack (``run``), the test that checks it offline (``check``: parsed, schema-checked, ``bash -n``) or the
one-line reason it is not run here (``not run``). A block the table does not classify, or a classified
block that is gone, fails :func:`test_every_block_is_classified`: new docs cannot slip in untested. The
offline checks of blocks no other module reads are here too."""

# ruff: noqa: E501  (the table's keys are the docs' own first lines, kept whole so they can be searched for)
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.docs import ROOT, doc_block, doc_blocks, fill

COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
HERE = "tests/docs/test_inventory.py"
CLIENT = "tests/docs/test_client_blocks.py"
OPERATOR = "tests/docs/test_operator_blocks.py"
FLEET = "tests/docs/test_fleet_blocks.py"
#: The four users' first hour on both stacks (embedded and Postgres + Redis + S3), which runs these blocks too.
FIRST_HOUR = "; and tests/docs/test_first_hour.py::test_first_hour"
OUTPUT = "not run: an answer or output shown, not something to run"
DOCKER = "not run: needs Docker (Compose); shell checked with bash -n"

BLOCKS: dict[tuple[str, str, str, str], str] = {
    ("README.md", "compilesvc", "sh", "make dev    # installs into .venv and runs the embedded serv"):
        "run: tests/cli/test_dev.py::test_dev_demo_builds_the_bundled_model (`compilesvc dev --demo`, what make "
        "dev runs; make test is the suite itself)" + FIRST_HOUR + " (the Makefile's dev command, then every user on it)",
    ("README.md", "Using it", "sh", "export COMPILESVC_API_URL=http://compilesvc.internal:8080 CO"):
        f"run: {CLIENT}::test_readme_using_it",
    ("README.md", "Using it", "yaml", 'model: {uri: "blob:sha256:<64 hex>", format: exported-progra'):
        f"check: {HERE}::test_the_specs_validate (the CLI's offline check, the API's rules)",
    ("README.md", "How it works", "", "CI ──POST /v1/builds──▶ API (web/) ──▶ ledger (SQL) ◀── rela"):
        "not run: a diagram",
    ("docs/architecture.md", "The core's layers", "text", "cli                      every `compilesvc` command, the rel"):
        "check: tests/test_layers.py::test_the_tree_keeps_every_contract (the diagram is the layers contract "
        "of pyproject.toml, which lint-imports checks)",
    ("docs/architecture.md", "The packages", "text", "server.cli               `compilesvc serve`"):
        "check: tests/test_layers.py::test_the_architecture_diagrams_are_the_layers_contracts (web's contract)",
    ("docs/architecture.md", "The packages", "text", "cli                      `compilesvc worker`"):
        "check: tests/test_layers.py::test_the_architecture_diagrams_are_the_layers_contracts (the workers' "
        "contract)",
    ("docs/api.md", "Conventions", "json", '{"type": "/problems/spec-invalid", "title": "Compile spec is'):
        f"check: {HERE}::test_json_blocks_without_ellipses_parse ({OUTPUT})",
    ("docs/api.md", "Uploading a model", "sh", "API=https://compilesvc.example.com COMPILESVC_TOKEN=csvc_…"):
        f"run: {CLIENT}::test_api_curl_blocks",
    ("docs/api.md", "Uploading a model", "sh", "curl -sS --data-binary @model.pt2 -H 'Content-Type: applicat"):
        f"run: {CLIENT}::test_api_curl_blocks",
    ("docs/api.md", "Submitting a build (CI)", "sh", 'curl -sS -X POST $API/v1/builds -H "Authorization: Bearer $C'):
        f"run: {CLIENT}::test_api_curl_blocks",
    ("docs/api.md", "Submitting a build (CI)", "json", '{"build_id": 42, "state": "building", "outcome": "new", "rep'):
        OUTPUT,
    ("docs/api.md", "Submitting a build (CI)", "json", '{"state": "succeeded", "attempts": 1, "error_code": null,'):
        OUTPUT,
    ("docs/api.md", "Submitting a build (CI)", "sh", 'key="ci-$CI_PIPELINE_ID-$CI_JOB_ID"          # one per logic'):
        f"run: {CLIENT}::test_api_curl_blocks",
    ("docs/api.md", "Following a build", "js", "const source = new EventSource(`/v1/builds/${id}/logs/stream"):
        "not run: browser code (EventSource) on a page with a session; tests/ui drives the UI's stream in Chromium",
    ("docs/api.md", "Fetching artifacts (serving fleets)", "sh", 'curl -sS -H "Authorization: Bearer $COMPILESVC_TOKEN" $API/v'):
        f"run: {CLIENT}::test_api_curl_blocks" + FIRST_HOUR + " (a fleet token; presigned S3 URLs on the full stack)",
    ("docs/api.md", "Webhooks", "json", '{"id": "whd_17", "type": "build.succeeded", "created_at": "2'): OUTPUT,
    ("docs/api.md", "Webhooks", "python", "import hashlib, hmac, time"):
        "run: tests/web/test_webhooks.py::test_a_build_end_is_delivered_signed_and_retried",
    ("docs/ci.md", "The client", "sh", 'pip install "compilesvc~=0.1.0"        # the client only, fr'):
        f"run: {CLIENT}::test_ci_client_then_following_cancelling_retrying (pip: a shim; the install itself: "
        "tests/workers/test_client_install.py)" + FIRST_HOUR,
    ("docs/ci.md", "What it prints", "json", '{"build_id": 42, "key": "0c02fae2…", "outcome": "new", "stat'): OUTPUT,
    ("docs/ci.md", "Following, cancelling, retrying", "sh", "compilesvc status 42 [--wait] [--json]    # state and bucket"):
        f"run: {CLIENT}::test_ci_client_then_following_cancelling_retrying" + FIRST_HOUR + " (status, logs, builds)",
    ("docs/ci.md", "GitHub Actions", "yaml", "name: compile"):
        "check: tests/deploy/test_docs_ci.py::test_the_ci_jobs_validate_against_their_schemas (and actionlint); needs "
        "GitHub to run",
    ("docs/ci.md", "GitHub Actions", "sh", "for attempt in 1 2 3; do"):
        "run: tests/workers/test_ci_pipeline.py::test_the_documented_retry_wrapper_retries_only_exit_3_and_keeps_every_status",
    ("docs/ci.md", "GitLab CI", "yaml", "compile:"):
        "check: tests/deploy/test_docs_ci.py::test_the_ci_jobs_validate_against_their_schemas; needs GitLab to run",
    ("docs/ci.md", "The spec", "yaml", "model: {uri: MODEL_URI, format: exported-program, name: tiny"):
        "run: tests/docs/test_first_hour.py::test_first_hour (filled for the cpu target: no Neuron SDK here); "
        f"check: {HERE}::test_the_specs_validate",
    ("docs/kubernetes.md", "What scales on what", "sql", "SELECT count(*) FROM bucket_compiles WHERE state IN ('queued"):
        "check: tests/deploy/test_helm_chart.py::test_the_query_docs_kubernetes_md_shows_is_the_chart_s (and that "
        "query runs on a real ledger in test_the_scaler_query_counts_queued_and_running_compiles_of_the_pool_on_a_real_ledger)",
    ("docs/kubernetes.md", "EKS, step by step", "sh", "kubectl create namespace compilesvc"):
        "not run: needs an EKS cluster; shell checked with bash -n; the values file it names is rendered and checked "
        "by tests/deploy/test_helm_chart.py",
    ("docs/api.md", "Webhooks", "python", "from standardwebhooks import Webhook"):
        "run: tests/web/test_webhook_destinations.py::test_the_standard_webhooks_library_verifies_our_signature "
        "(the same library and calls, on a delivery the relay sent)",
    ("docs/fleet.md", "Signed artifacts, trusted keys", "text", "error: refused: 5b1e… (the API's resolve answer) is a validl"):
        OUTPUT + "; the refusals are tests/fleet/test_spec_binding.py's",
    ("docs/kubernetes.md", "bwrap pools", "sh", "helm upgrade --install compilesvc-bwrap deploy/helm/compiles"):
        "not run: needs a cluster; shell checked with bash -n; the release it makes (workers alone) is rendered by "
        "tests/deploy/test_platform_contracts.py::test_bwrap_pools_render_as_a_release_of_workers_alone",
    ("docs/kubernetes.md", "EKS, step by step", "sh", "PGHOST=<rds endpoint> PGSSLMODE=require POSTGRES_USER=<maste"):
        "run: tests/ledger/test_roles.py::test_the_init_script_runs_as_an_rds_master_user (the script, as a CREATEROLE "
        "non-superuser owner of a private Postgres: RDS's master user; the endpoint and passwords are the reader's)",
    ("docs/kubernetes.md", "The first hour, each a command", "sh", "# 1. The signing key (EC P-256, PKCS#8): the private half st"):
        "not run: needs an EKS cluster and its API; shell checked with bash -n; the signing-key and token commands "
        "are docs/deploy.md's and docs/security.md's, run there",
    ("docs/kubernetes.md", "The first hour, each a command", "sql", "CREATE ROLE compilesvc_scaler LOGIN PASSWORD 'choose-one';"):
        "run: tests/deploy/test_helm_chart.py::test_the_scaler_query_counts_queued_and_running_compiles_of_the_pool_on_a_real_ledger "
        "(under a role of the test's own name, which then runs the scaler query and is refused another table)",
    ("docs/deploy.md", "Quick start", "sh", "cp docker/env.example .env     # then replace every change-m"): DOCKER,
    ("docs/deploy.md", "Slow clients", "sh", "make test-tools    # installs nginx (apt-get, as root) when"):
        "not run: installs packages as root, then runs tests/faults/test_slow_clients.py, which the suite runs",
    ("docs/deploy.md", "Secrets", "sh", "for v in POSTGRES_PASSWORD POSTGRES_API_PASSWORD POSTGRES_WO"):
        f"run: {HERE}::test_the_secrets_loop_replaces_every_placeholder",
    ("docs/deploy.md", "Signing keys", "sh", "openssl ecparam -name prime256v1 -genkey -noout | openssl pk"):
        f"run: {OPERATOR}::test_operator_blocks",
    ("docs/deploy.md", "Signing keys", "sh", "compilesvc sign-artifacts --all --dry-run     # verify only"):
        f"run: {OPERATOR}::test_operator_blocks",
    ("docs/deploy.md", "Scaling workers", "sh", "docker compose up -d --scale worker-cpu=4          # four co"): DOCKER,
    ("docs/deploy.md", "Workers on other hosts", "yaml", "services:"):
        f"check: {HERE}::test_the_compose_override_validates (needs Docker to run)",
    ("docs/deploy.md", "AWS S3 instead of SeaweedFS", "sh", "# .env"):
        "not run: needs an AWS account and bucket; shell checked with bash -n",
    ("docs/deploy.md", "Retention", "sh", "compilesvc gc --dry-run     # what would go, and why; change"):
        f"run: {OPERATOR}::test_operator_blocks" + FIRST_HOUR + " (the dry run)",
    ("docs/deploy.md", "Retention", "sh", 'compilesvc pins add --artifact KEY --note "fleet search-prod'):
        f"run: {OPERATOR}::test_operator_blocks",
    ("docs/deploy.md", "Dependencies", "sh", "make test-upstream                                        #"):
        "check: tests/deploy/test_upstream.py::test_dry_run_prints_the_plan_and_runs_nothing (its plan, and its "
        "arguments in the same file; a real run takes a full install and the fault suite once per package)",
    ("docs/deploy.md", "Operations", "sh", "docker compose logs -f api relay worker-cpu        # JSON li"): DOCKER,
    ("docs/deploy.md", "Checking the file", "sh", "docker compose config -q                             # Compo"):
        f"{DOCKER}; its last line is tests/deploy/test_compose.py, which the suite runs",
    ("docs/fleet.md", "`compilesvc fetch`", "sh", "compilesvc fetch KEY                      # into the cache;"):
        f"run: {FLEET}::test_fleet_blocks" + FIRST_HOUR,
    ("docs/fleet.md", "Signed artifacts, trusted keys", "sh", "compilesvc fetch KEY --dest ./artifact"):
        f"run: {FLEET}::test_fleet_blocks" + FIRST_HOUR,
    ("docs/fleet.md", "Signed artifacts, trusted keys", "text", "error: refused: the manifest of artifact 9f2c… is not the on"):
        f"{OUTPUT}; tests/fleet/test_signatures.py provokes each refusal",
    ("docs/fleet.md", "Booting an inf2 instance", "sh", "#!/bin/sh"):
        "not run: needs an inf2 host and AWS Secrets Manager; shell checked with bash -n",
    ("docs/fleet.md", "Serving code: `compilesvc.fleet`", "python", "from compilesvc.fleet import ArtifactSet, NoBucketFits, crop"):
        f"run: {FLEET}::test_fleet_blocks" + FIRST_HOUR,
    ("docs/llm.md", "The spec", "yaml", "model:"):
        "run: tests/docs/test_llm_doc.py::test_the_llm_spec_validates_and_keys (parsed and keyed as a submit would)",
    ("docs/llm.md", "Compiling in CI, for trn2 and trn3", "yaml", "name: llm-artifacts"):
        "check: tests/deploy/test_docs_ci.py::test_the_ci_jobs_validate_against_their_schemas (and actionlint); needs "
        "GitHub and a Neuron fleet to run",
    ("docs/llm.md", "A vLLM fleet that boots offline", "sh", "compilesvc fetch --spec /etc/serving/llama.yaml          # o"):
        "not run: needs a Neuron host and vLLM; shell checked with bash -n; the same commands (fetch --offline, "
        "serve-env, the check) run in tests/workers/test_llm_e2e.py",
    ("docs/llm.md", "Trying it locally", "sh", "export COMPILESVC_NEURON_SDK=2.27.1   # the release this env"):
        "run: tests/cli/test_dev_llm.py::test_docs_llm_trying_it_locally_runs_as_written (with the Neuron double's "
        "environment in the SDK's place; its own port)",
    ("docs/llm.md", "Trying it locally", "sh", 'export COMPILESVC_TOKEN="$(cat .compilesvc/admin-token)" COM'):
        "run: tests/cli/test_dev_llm.py::test_docs_llm_trying_it_locally_runs_as_written (its own serving "
        "directory); tests/cli/test_dev_llm.py::test_an_llm_compiles_on_the_embedded_default_and_boots_a_vllm_host_offline "
        "adds the API stopped, an uploaded archive and the refusals",
    ("docs/fleet.md", "LLM artifacts for vLLM", "sh", "compilesvc serve-env KEY                              # or -"):
        "not run: needs a Neuron host and vLLM; shell checked with bash -n; the same eval and check run in "
        "tests/fleet/test_serve_env.py::test_a_fleet_host_gets_the_vllm_environment_and_keeps_it_with_the_api_gone",
    ("docs/fleet.md", "LLM artifacts for vLLM", "text", "error: --tensor-parallel-size 4 but the artifact was compile"):
        f"{OUTPUT}; tests/fleet/test_llm_serving.py::test_each_mismatch_is_refused_with_its_line provokes each",
    ("docs/fleet.md", "Rolling forward to a new SDK release", "sh", "compilesvc rollforward --from-sdk 2.20.0 --to-sdk 2.21.0 --d"):
        f"run: {OPERATOR}::test_operator_blocks (the dry run; the campaign itself: "
        "tests/workers/test_rollforward.py)",
    ("docs/fleet.md", "Roll-forwards that start themselves", "sh",
     "compilesvc rollforward-policies add search --label fleet=sea"):
        "run: tests/workers/test_rollforward_policy.py::test_policies_from_the_command_line (the same commands and "
        "options, through the CLI's main); the policy firing: "
        "tests/workers/test_rollforward_policy.py::test_the_first_worker_of_a_new_release_starts_the_policys_campaign",
    ("docs/keys.md", "What goes into the key, and why", "json", "{"): f"{OUTPUT} (`compilesvc key --json`)",
    ("docs/keys.md", "Explaining a cache miss", "console", "$ compilesvc key examples/inf2-llama/spec.json --explain"):
        f"run: {HERE}::test_the_explained_key_is_what_the_cli_prints",
    ("docs/keys.md", "Golden vectors", "console", '# Add a case: append {"name", "spec", "model_sha256", "isa",'):
        "not run: rewrites the golden vectors, a deliberate act (tests/spec/test_keys.py checks them)",
    ("docs/keys.md", "The CLI", "console", "compilesvc key SPEC [--explain | --json] [--isa ISA] [--salt"):
        "run: tests/cli/test_main.py::test_explain_output (a synopsis; key, migrate and version each have tests there)",
    ("docs/neuron-hosts.md", "First, on every new host: `compilesvc doctor`", "sh", "# A DLAMI or any host with the SDK (Option 2): in the Neuron"):
        "run: tests/workers/host/test_doctor.py::test_a_device_less_host_compiles_through_trace_and_neuronx_cc_and_skips_the_load "
        "(with the Neuron double; the docker line needs Docker)" + FIRST_HOUR + " (the first line, on this host without Neuron)",
    ("docs/neuron-hosts.md", "First, on every new host: `compilesvc doctor`", "text", "compilesvc doctor: PASS"): OUTPUT,
    ("docs/neuron-hosts.md", "Option 1: the container (recommended)", "sh", "# .env (see docker/env.example)"):
        "not run: needs Docker and a Neuron DLC image; shell checked with bash -n",
    ("docs/neuron-hosts.md", "Option 2: a DLAMI or any host with the Neuron SDK", "sh", "python3.11 -m venv /opt/compilesvc && . /opt/compilesvc/bin/"):
        "not run: needs a Neuron host and AWS's Neuron index; shell checked with bash -n",
    ("docs/security.md", "Tokens", "sh", "# The first admin of a deployment, straight into the ledger"):
        f"run: {OPERATOR}::test_operator_blocks" + FIRST_HOUR,
    ("docs/security.md", "Team boundary for reads", "sh", "compilesvc tokens create --name fleet-vision-prod --owner se"):
        f"run: {OPERATOR}::test_operator_blocks",
}


def test_every_block_is_classified() -> None:
    found = [block.ident for block in doc_blocks()]
    assert len(found) == len(set(found)), "two blocks under one heading start alike: make their first lines differ"
    unclassified = [ident for ident in found if ident not in BLOCKS]
    gone = [ident for ident in BLOCKS if ident not in found]
    assert not unclassified, f"blocks nobody runs or checks: add each to BLOCKS with its test or reason: {unclassified}"
    assert not gone, f"classified blocks that are no longer in the docs: remove them from BLOCKS: {gone}"


def test_every_named_test_exists() -> None:
    for ident, what in BLOCKS.items():
        kind, _, rest = what.partition(": ")
        assert kind in ("run", "check", "not run"), (ident, what)
        if kind == "not run":
            continue
        assert re.match(r"([\w/.]+)::(\w+)", rest), f"{ident}: {what!r} names no test (path::name)"
        for path, name in re.findall(r"(tests/[\w/.]+)::(\w+)", rest):  # every test it names, not only the first
            tree = ast.parse((ROOT / path).read_text())
            names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
            assert name in names, f"{ident}: {path} has no test {name}"


@pytest.mark.parametrize("block", [b for b in doc_blocks() if b.lang == "sh"], ids=lambda b: f"{b.file}:{b.line}")
def test_every_shell_block_parses(block: object) -> None:
    run = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)  # type: ignore[attr-defined]
    assert run.returncode == 0, run.stderr


def test_json_blocks_without_ellipses_parse() -> None:
    shown = [b for b in doc_blocks() if b.lang == "json" and "…" not in b.text]
    assert shown, "no JSON block left to parse: drop this test and its entries"
    for block in shown:
        json.loads(block.text)


def key(spec: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([COMPILESVC, "key", str(spec)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_specs_validate(tmp_path: Path) -> None:
    sha = "ab" * 32  # the model's sha256: any will do for the key
    readme = fill(doc_block("README.md", "A spec (JSON, or YAML for the CLI):", lang="yaml"),
                  {"<64 hex>": sha})
    ci = fill(doc_block("ci.md", "## The spec", lang="yaml"), {"MODEL_URI": f"blob:sha256:{sha}"})
    for name, text in (("readme.yaml", readme), ("ci.yaml", ci)):
        (tmp_path / name).write_text(text)
        run = key(tmp_path / name)
        assert run.returncode == 0 and len(run.stdout.strip()) == 64, f"{name}: {run.stderr}"
    assert yaml.safe_load(ci)["sdk"] == "2.27.1"  # quoted, as the comment says


def test_the_explained_key_is_what_the_cli_prints() -> None:
    command, *shown = doc_block("keys.md", "## Explaining a cache miss", lang="console").splitlines()
    run = subprocess.run([COMPILESVC, *command.removeprefix("$ compilesvc ").split()], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    printed = run.stdout.splitlines()
    for line in shown:
        if "…" not in line:
            assert line in printed, f"keys.md shows {line!r}; the CLI prints:\n{run.stdout}"


def test_the_secrets_loop_replaces_every_placeholder(tmp_path: Path) -> None:
    shutil.copy(ROOT / "docker" / "env.example", tmp_path / ".env")
    before = (tmp_path / ".env").read_text()
    subprocess.run(["bash", "-e", "-c", doc_block("deploy.md", "## Secrets")], cwd=tmp_path, check=True,
                   timeout=60)
    after = (tmp_path / ".env").read_text()
    left = [line for line in after.splitlines() if "change-me" in line and not line.startswith("#")]
    assert after != before and not left, left


def test_the_compose_override_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema belongs in the dev extra")
    override = yaml.safe_load(doc_block("deploy.md", "### Workers on other hosts", lang="yaml"))
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(override))
    assert not errors, [error.message for error in errors]
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert set(override["services"]) <= set(base), "the override names a service docker-compose.yml does not have"
