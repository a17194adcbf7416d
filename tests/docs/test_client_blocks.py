"""The client's blocks of README.md, docs/ci.md and docs/api.md, run as written against a real service (API,
relay and a worker compiling with the real TorchScript backend). Only placeholders are replaced, each by
:func:`fill`, which fails when the placeholder is gone: the API's address, the token, a key, a build id."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from compilesvc.signing.keys import TRUSTED_KEYS_ENV, public_key_path
from tests.docs.conftest import MakeCluster, Shell
from tests.fixtures.docs import doc_block, fill
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.workers.conftest import Cluster

#: The model the docs' examples upload (``model.pt2``, torch.export.save) is a real exported program.
CPU_SPEC = {"target": "cpu", "sdk": "2.13.0", "compiler": {"backend": "torchscript"},
            "buckets": [{"batch_size": 1, "seq_len": 16}, {"batch_size": 2, "seq_len": 32}]}


def user_shell(cluster: Cluster, port: int, work: Path) -> Shell:
    """A client's shell: the service's settings gone, the CLI's cache in ``work`` and the service's public
    signing key trusted (as a fleet's config gives it; docs/fleet.md)."""
    env = cluster.client_env(port, work)
    for name in ("COMPILESVC_API_URL", "COMPILESVC_TOKEN"):  # the blocks export these themselves
        env.pop(name)
    env.update({"XDG_CACHE_HOME": str(work / "cache"), "HOME": str(work),
                TRUSTED_KEYS_ENV: str(public_key_path(cluster.settings.data_dir / "signing-key.pem"))})
    return Shell(env, work)


def write_spec(work: Path, uri: str, name: str = "tiny-bert", **extra: object) -> dict[str, object]:
    spec = {"model": {"uri": uri, "format": "exported-program", "name": name}, **CPU_SPEC, **extra}
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    return spec


def test_readme_using_it(make_cluster: MakeCluster, tiny_torch_model: Path, tmp_path: Path) -> None:
    cluster = make_cluster()
    port = cluster.start_service()
    work = tmp_path / "user"
    work.mkdir()
    shutil.copy(tiny_torch_model, work / "model.pt2")
    uri = cluster.upload(tiny_torch_model.read_bytes(), "model.pt2")  # content-addressed: what upload prints
    write_spec(work, uri)
    shell = user_shell(cluster, port, work)
    key = shell.run("compilesvc key spec.json").stdout.strip()
    block = fill(doc_block("README.md", "## Using it"), {
        "http://compilesvc.internal:8080": f"http://127.0.0.1:{port}", "csvc_…": BOOTSTRAP_TOKEN,
        "fetch KEY": f"fetch {key}"})
    out = shell.run(block).stdout.splitlines()
    assert out[0] == uri
    assert out[1].split() == ["artifact", "key", key]  # --explain starts with the key
    assert key in out
    directory = Path(out[-1])
    assert directory.name == key and (directory / "manifest.json").is_file()


def test_ci_client_then_following_cancelling_retrying(make_cluster: MakeCluster, tiny_torch_model: Path,
                                                     tmp_path: Path) -> None:
    cluster = make_cluster()
    port = cluster.start_service()
    work = tmp_path / "job"
    (work / "bin").mkdir(parents=True)
    shutil.copy(tiny_torch_model, work / "model.pt2")
    write_spec(work, cluster.upload(tiny_torch_model.read_bytes(), "model.pt2"))
    shell = user_shell(cluster, port, work)
    # pip is this checkout's install already (tests/workers/test_client_install.py installs the client alone);
    # a shim records what the block asks of it.
    (work / "bin" / "pip").write_text('#!/bin/sh\necho "$@" > "$PIP_ARGS"\n')
    (work / "bin" / "pip").chmod(0o755)
    shell.env["PATH"] = f"{work / 'bin'}:{shell.env['PATH']}"
    block = fill(doc_block("ci.md", "## The client"), {
        "https://compilesvc.example.com": f"http://127.0.0.1:{port}", "csvc_…": BOOTSTRAP_TOKEN})
    run = shell.run(block, PIP_ARGS=str(work / "pip-args"))
    assert (work / "pip-args").read_text().split() == ["install", "compilesvc~=0.1.0"]
    assert run.stdout.strip() == shell.run("compilesvc key spec.yaml").stdout.strip()

    # "Following, cancelling, retrying": each line as written (42: a build of ours), then with its
    # [optional] parts.
    slow = cluster.hlo_spec("slow:60")
    (work / "slow.json").write_text(json.dumps(slow))
    build = shell.run("compilesvc submit slow.json --no-wait", COMPILESVC_API_URL=f"http://127.0.0.1:{port}",
                      COMPILESVC_TOKEN=BOOTSTRAP_TOKEN).stdout.strip()
    lines = [line.split("#")[0].strip()
             for line in fill(doc_block("ci.md", "### Following, cancelling, retrying"), {" 42": f" {build}"})
             .splitlines()]
    expected = {"status": 0, "logs": 0, "cancel": 0, "retry": 0, "builds": 0}
    client = {"COMPILESVC_API_URL": f"http://127.0.0.1:{port}", "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN}
    for line in lines:
        bare = re.sub(r" \[[^]]*\]", "", line)
        run = shell.run(bare, check=False, **client)
        assert run.returncode == expected[line.split()[1]], f"{bare}: {run.stderr}"
    shell.run(f"compilesvc cancel {build}", **client)  # the retry queued it again
    status, logs, *_, builds = [re.sub(r" \[([^]]*)\]", r" \1", line) for line in lines]
    assert status.endswith("--wait --json") and logs.endswith("--follow --bucket 1")
    run = shell.run(status, check=False, **client)
    assert run.returncode == 4 and json.loads(run.stdout)["result"] == "cancelled", run.stderr
    assert shell.run(logs, check=False, timeout=120, **client).returncode == 0
    # The documented filters (target inf2, failed, a label) match none of ours: the answer is an empty list.
    assert json.loads(shell.run(builds, **client).stdout) == []
    listed = json.loads(shell.run("compilesvc builds --json", **client).stdout)
    assert str(build) in {str(item["build_id"]) for item in listed}, listed


def test_api_curl_blocks(make_cluster: MakeCluster, tiny_torch_model: Path, tmp_path: Path) -> None:
    cluster = make_cluster()
    port = cluster.start_service()
    work = tmp_path / "http"
    work.mkdir()
    shutil.copy(tiny_torch_model, work / "model.pt2")
    shell = user_shell(cluster, port, work)
    shell.env.update({"API": f"http://127.0.0.1:{port}", "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN})  # as set above
    upload = json.loads(shell.run(fill(doc_block("api.md", "## Uploading a model"), {
        "https://compilesvc.example.com": f"http://127.0.0.1:{port}", "csvc_…": BOOTSTRAP_TOKEN})).stdout)
    assert upload["uri"].startswith("blob:sha256:") and upload["size"] == tiny_torch_model.stat().st_size
    digest = json.loads(shell.run(doc_block("api.md", "so a client that hashed with another algorithm")).stdout)
    assert digest == {**upload, "created": False}
    write_spec(work, upload["uri"])
    submitted = json.loads(shell.run(doc_block("api.md", "## Submitting a build (CI)")).stdout)
    assert submitted["outcome"] == "new" and submitted["build_id"] == 1, submitted
    loop = doc_block("api.md", "every try.")
    shell.run(loop, CI_PIPELINE_ID="8812", CI_JOB_ID="3")
    first = json.loads((work / "answer.json").read_text())
    assert (first["build_id"], first["outcome"], first["replayed"]) == (2, "join", False), first
    shell.run(loop, CI_PIPELINE_ID="8812", CI_JOB_ID="3")  # a re-run of the job: its first submit, replayed
    again = json.loads((work / "answer.json").read_text())
    assert (again["build_id"], again["replayed"]) == (2, True), again
    key = submitted["artifact_key"]
    cluster.wait_artifact(key, ("published",), timeout=120)
    manifest = json.loads(shell.run(fill(doc_block("api.md", "## Fetching artifacts (serving fleets)"), {
        "0c02fae24be4d2e40c63d9dd69bc7aab94fc67b7dd588f20a0cafafb995ff5b2": key})).stdout)
    assert manifest["key"] == key, manifest
