"""The first hour of each of the four users, end to end, through the commands as README.md and docs/ write
them: on the embedded default (``compilesvc dev --demo``, as ``make dev`` runs it: SQLite, the filesystem
broker and a local store under ``./.compilesvc``) and on Postgres + Redis + S3 (``weed mini``) with
``compilesvc serve``/``worker``/``relay``.

In order: the operator makes tokens (docs/security.md); the CI engineer installs the client, uploads and
submits (docs/ci.md: the client block and its spec), follows the build (status, logs, builds), submits it
again (a hit) and with a flag changed (a miss), and meets every exit status of docs/ci.md (1 a file that is
no model, 2 a bad spec, 3 ``--timeout`` passed, 4 cancelled); the engineer in the UI logs in at ``/login``
and reads the history, the build's page (buckets, why the key missed, the hit's reused buckets) and its log
(docs/api.md, "Web UI");
the fleet engineer fetches, verifies and serves the artifact (docs/fleet.md); the operator runs
``compilesvc gc --dry-run`` (docs/deploy.md) and ``compilesvc doctor`` (docs/neuron-hosts.md) on this host,
which has no Neuron SDK. Only placeholders are replaced, each by :func:`fill`.

What cannot run here as written, and what stands in for it:
- docs/deploy.md starts the full stack with ``docker compose up`` (no Docker here): the same processes run
  as the compose file's commands (``compilesvc serve``, ``worker``, ``relay``) from the cluster fixture.
- docs/ci.md's spec is for ``target: inf2`` (no Neuron SDK here): it is filled for the cpu target (the torch
  release as ``sdk``, the torchscript backend instead of the Neuron flags); its model and buckets are as
  written. README's spec is not the one submitted: its second bucket names ``input_ids`` alone, which a
  model taking an attention mask (the docs' tiny-bert) cannot compile.
- ``pip install`` is a shim recording its arguments: this checkout is installed already
  (tests/workers/test_client_install.py installs the client alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from compilesvc.signing.keys import TRUSTED_KEYS_ENV, public_key_path
from tests.docs.conftest import Shell
from tests.fixtures.docs import ROOT, doc_block, fill
from tests.fixtures.ports import free_port
from tests.fixtures.waiting import wait_for

COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
TORCH_RELEASE = "2.13.0"  # the cpu target's "sdk": the workers' torch release


def clean_env() -> dict[str, str]:
    """A user's environment: none of the service's settings (nor the inductor cache importing torch sets)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}


@dataclass
class Stack:
    """A running service as its users meet it: the URL, where an operator's server commands run (their
    environment and directory), the public key fleets trust and where downloads come from."""

    base: str
    server_env: dict[str, str]
    server_dir: Path
    public_key: Path
    downloads: str  # where the manifest's download URLs point: this API's blobs, or the S3 server

    def server(self) -> Shell:
        return Shell(dict(self.server_env), self.server_dir)


@contextlib.contextmanager
def embedded(tmp_path: Path) -> Iterator[Stack]:
    """README's first command: ``make dev`` is ``compilesvc dev --demo`` in the checkout (here a directory of
    its own, so its ``.compilesvc`` is this test's), on a free port instead of 8080."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    make_dev = re.search(r"^dev:.*\n\t\$\(BIN\)/(compilesvc dev[^\n]*)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_dev is not None, "the Makefile's dev target no longer runs compilesvc dev"
    port = free_port()
    out = tmp_path / "dev.out"
    env = {**clean_env(), "HOME": str(tmp_path)}
    with open(out, "wb") as sink:
        proc = subprocess.Popen([COMPILESVC, *make_dev[1].split()[1:], "--port", str(port)], env=env, cwd=checkout,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "Ctrl-C stops it." in out.read_text() or proc.poll() is not None, 240, "compilesvc dev")
        printed = out.read_text()
        assert proc.poll() is None, printed
        assert re.search(r"^demo build 1 succeeded in", printed, re.M), printed
        trust = re.search(rf"export {TRUSTED_KEYS_ENV}=(\S+)$", printed, re.M)
        assert trust is not None, printed
        base = f"http://127.0.0.1:{port}"
        yield Stack(base, env, checkout, Path(trust[1]), f"{base}/v1/blobs/")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # dev stops its children on SIGTERM
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextlib.contextmanager
def full(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """Postgres + Redis + S3: the cluster fixture's processes with the store in a bucket of ``weed mini``."""
    s3 = request.getfixturevalue("s3_server")
    make_cluster = request.getfixturevalue("make_cluster")
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)  # the fixture's in-process services use the same store
    cluster = make_cluster(store_url=f"s3://{s3.new_bucket('firsthour')}/artifacts", extra_env=s3.env(),
                           s3_endpoint_url=s3.endpoint_url)
    port = cluster.start_service()
    yield Stack(f"http://127.0.0.1:{port}", cluster.env, tmp_path,
                public_key_path(cluster.settings.data_dir / "signing-key.pem"), f"{s3.endpoint_url}/")


def user(stack: Stack, home: Path, token: str, **extra: str) -> Shell:
    """A user's shell in ``home`` (their HOME and cache: no config file) with the stack's URL and ``token``."""
    home.mkdir(exist_ok=True)
    return Shell({**clean_env(), "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"),
                  "COMPILESVC_API_URL": stack.base, "COMPILESVC_TOKEN": token, **extra}, home)


def operator_makes_tokens(stack: Stack, tmp_path: Path) -> dict[str, str]:
    """docs/security.md "Making tokens": the first admin straight into the ledger, then through the API."""
    first, *rest = [line for line in doc_block("security.md", "Making tokens:").splitlines()
                    if line.strip() and not line.startswith("#")]
    assert "--ledger" in first and "--scope admin" in first, first
    ops = stack.server().run(first).stdout.strip()
    assert re.fullmatch(r"csvc_[\w-]{43}", ops), ops
    admin = user(stack, tmp_path / "operator", ops)
    leaver = json.loads(admin.run("compilesvc tokens create --name leaver --owner bob --scope read --json").stdout)
    made = admin.run(fill("\n".join(rest), {"[--all]": "--all", "revoke 7": f"revoke {leaver['id']}"}))
    secrets = re.findall(r"^csvc_\S+$", made.stdout, re.M)
    assert len(secrets) == 2, made.stdout + made.stderr
    for name in ("ops", "ci-vision", "fleet-prod", "leaver"):
        assert name in made.stdout, made.stdout
    assert "scopes submit" in made.stderr and "scopes fleet" in made.stderr, made.stderr
    listed = admin.run("compilesvc tokens list").stdout
    assert "leaver" not in listed and "ci-vision" in listed, listed  # revoked, so gone from the list
    return {"admin": ops, "ci": secrets[0], "fleet": secrets[1]}


def following_lines(build: int) -> list[str]:
    """docs/ci.md's "Following, cancelling, retrying" commands for ``build`` (its 42), comments cut."""
    block = fill(doc_block("ci.md", "### Following, cancelling, retrying"), {" 42": f" {build}"})
    return [line.split("#")[0].strip() for line in block.splitlines()]


def ci_engineer(stack: Stack, token: str, model: Path,
                tmp_path: Path) -> tuple[Shell, str, str, int, int, str]:
    """docs/ci.md: the client block with its spec (for cpu), a hit on the second submit, then "Following".
    Returns the job's shell, the spec, the model's URI, the build, the hit's build and the artifact key."""
    job = user(stack, tmp_path / "ci", token)
    (job.cwd / "bin").mkdir()
    shutil.copy(model, job.cwd / "model.pt2")
    (job.cwd / "bin" / "pip").write_text('#!/bin/sh\necho "$@" > "$PIP_ARGS"\n')
    (job.cwd / "bin" / "pip").chmod(0o755)
    job.env["PATH"] = f"{job.cwd / 'bin'}:{job.env['PATH']}"
    uri = f"blob:sha256:{hashlib.sha256(model.read_bytes()).hexdigest()}"  # what upload prints: content-addressed
    spec = fill(doc_block("ci.md", "## The spec", lang="yaml"), {
        "MODEL_URI": uri, "target: inf2": "target: cpu", '"2.27.1"': f'"{TORCH_RELEASE}"',
        'compiler: {args: ["--auto-cast", "matmult"]}': "compiler: {backend: torchscript}"})
    (job.cwd / "spec.yaml").write_text(spec)
    for name in ("COMPILESVC_API_URL", "COMPILESVC_TOKEN"):  # the block exports them itself
        job.env.pop(name)
    block = fill(doc_block("ci.md", "## The client"), {"https://compilesvc.example.com": stack.base, "csvc_…": token})
    run = job.run(block + '\necho "$uri" >&2', timeout=180, PIP_ARGS=str(job.cwd / "pip-args"))
    assert (job.cwd / "pip-args").read_text().split() == ["install", "compilesvc~=0.1.0"]
    key = run.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key), run.stdout + run.stderr
    assert run.stderr.rstrip().endswith(uri), run.stderr
    page = re.search(rf"{re.escape(stack.base)}/builds/(\d+)", run.stderr)
    assert page is not None, run.stderr
    build = int(page[1])
    assert re.search(r"bucket 1 \(input_ids: int64\[4, 128\], attention_mask: int64\[4, 128\]\)", run.stderr)

    job.env.update({"COMPILESVC_API_URL": stack.base, "COMPILESVC_TOKEN": token})  # as the block exported them
    again = job.run("compilesvc submit spec.yaml --json")  # exit 0: a hit, the same key
    answer = json.loads(again.stdout)
    assert (answer["key"], answer["outcome"], answer["exit_code"], answer["result"]) == (key, "hit", 0, "succeeded")

    following = following_lines(build)
    status = re.sub(r" \[([^]]*)\]", r" \1", following[0])  # --wait --json: ended already, so at once
    assert status == f"compilesvc status {build} --wait --json", status
    state = json.loads(job.run(status).stdout)
    assert (state["state"], state["exit_code"], state["key"]) == ("succeeded", 0, key), state
    assert [b["state"] for b in state["buckets"]] == ["succeeded", "succeeded"], state
    logs = re.sub(r" \[[^]]*\]", "", following[1])
    assert logs == f"compilesvc logs {build}", logs
    printed_log = job.run(logs).stdout
    for position in (0, 1):  # each line labelled with its bucket; the compiler's own lines among them
        assert f"[bucket {position}] compiler exited with 0" in printed_log, printed_log
        assert f"[bucket {position}] [compile-child] ok in" in printed_log, printed_log
    mine = fill(following[4], {"--target inf2 --state failed": "--target cpu --state succeeded", "[--json]": "--json"})
    listed = json.loads(job.run(mine).stdout)
    assert build in [item.get("build_id", item.get("id")) for item in listed], listed
    return job, spec, uri, build, answer["build_id"], key


def ci_exit_statuses(job: Shell, stack: Stack, spec: str, uri: str, key: str) -> int:
    """The CI engineer's next runs: a flag changed (a new key, exit 0), then each other exit status of
    docs/ci.md. Returns the flagged build, whose page says why its key missed."""
    # The next commit of the pipeline turns on a flag: a new key, whose page says why (ui_engineer).
    flag = {"{backend: torchscript}": '{backend: torchscript, args: ["--freeze"]}'}
    (job.cwd / "spec.yaml").write_text(fill(spec, flag))
    flagged = job.run("compilesvc submit spec.yaml", timeout=180)
    assert re.fullmatch(r"[0-9a-f]{64}", flagged.stdout.strip()) and flagged.stdout.strip() != key, flagged.stderr
    missed = re.search(rf"{re.escape(stack.base)}/builds/(\d+)", flagged.stderr)
    assert missed is not None, flagged.stderr
    # A file that is no exported program: the model does not compile (exit 1, on the first attempt).
    (job.cwd / "broken.pt2").write_bytes(b"not an exported program")
    broken_uri = job.run("compilesvc upload broken.pt2").stdout.strip()
    (job.cwd / "broken.yaml").write_text(fill(spec, {uri: broken_uri}))
    broken = job.run("compilesvc submit broken.yaml --json", check=False, timeout=180)
    failed = json.loads(broken.stdout)  # with --json the document is written for failed builds too
    assert (broken.returncode, failed["result"], failed["exit_code"]) == (1, "compile_error", 1), broken.stderr
    # The first bucket to fail ends the build: the other failed the same way, was stopped or is still stopping
    # (seen: "running" in the answer); none was tried twice.
    tried = [(b["state"], b["error_class"], b["attempts"]) for b in failed["buckets"]]
    assert ("failed", "compile", 1) in tried and all(attempts <= 1 for *_, attempts in tried), tried
    assert "cannot load the exported-program model" in broken.stderr, broken.stderr  # the whole message
    assert re.search(rf"^error: build {failed['build_id']} failed \(compile_error\)", broken.stderr, re.M)
    # A third bucket outlives --timeout (exit 3; the build keeps running), then is cancelled (exit 4).
    two = "  - {batch_size: 4, seq_len: 128}\n"
    (job.cwd / "wider.yaml").write_text(fill(spec, {two: two + "  - {batch_size: 8, seq_len: 128}\n"}))
    waited = job.run("compilesvc submit wider.yaml --timeout 1", check=False)
    assert waited.returncode == 3 and "is still building; it keeps running" in waited.stderr, waited.stderr
    running = re.search(rf"{re.escape(stack.base)}/builds/(\d+)", waited.stderr)
    assert running is not None, waited.stderr
    following = following_lines(int(running[1]))
    assert following[2] == f"compilesvc cancel {running[1]}", following
    job.run(following[2])
    cancelled = job.run(re.sub(r" \[([^]]*)\]", r" \1", following[0]), check=False, timeout=120)
    assert (cancelled.returncode, json.loads(cancelled.stdout)["result"]) == (4, "cancelled"), cancelled.stderr
    bad = job.run("compilesvc submit missing.yaml", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error:"), bad.stderr  # exit 2: bad input
    return int(missed[1])


def ui_engineer(stack: Stack, token: str, build: int, hit: int, missed: int, key: str) -> None:
    """docs/api.md "Web UI": log in at /login with a read-or-better token, then the history and the build."""
    browser = requests.Session()
    assert browser.get(f"{stack.base}/", allow_redirects=False, timeout=30).status_code in (302, 303)
    form = browser.get(f"{stack.base}/login", timeout=30)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert csrf is not None, form.text
    login = browser.post(f"{stack.base}/login", data={"csrf_token": csrf[1], "next": "/", "token": token},
                         allow_redirects=False, timeout=30)
    assert login.status_code == 303, login.text
    history = browser.get(f"{stack.base}/", timeout=30)
    assert history.status_code == 200 and f"/builds/{build}" in history.text and "tiny-bert" in history.text
    for outcome in ("hit", "built", "partly reused (2 of 3)"):  # the cancelled build reused two buckets
        assert outcome in history.text, f"the history shows no {outcome!r}"
    page = browser.get(f"{stack.base}/builds/{build}", timeout=30)
    assert page.status_code == 200, page.text
    text = re.sub(r"\s+", " ", page.text)
    for shown in ("Buckets", "[1, 128]", "[4, 128]", "compiled by this build", key[:16], "why it missed",
                  "The first artifact of this model: there was nothing earlier to reuse.", f"/builds/{build}/log.txt"):
        assert shown in text, f"the build page does not show {shown!r}"
    why = re.sub(r"\s+", " ", browser.get(f"{stack.base}/builds/{missed}", timeout=30).text)
    changes = re.search(r'asked for by <a href="/builds/(\d+)">.*?<ul class="changes" id="key-changes">(.*?)</ul>', why)
    assert changes is not None and int(changes[1]) == build, why
    assert "--freeze" in changes[2], changes[2]  # the one flag that made the key new
    reused = re.sub(r"\s+", " ", browser.get(f"{stack.base}/builds/{hit}", timeout=30).text)
    assert reused.count(f'reused from <a href="/builds/{build}">build {build}</a>') == 2, reused  # both buckets
    log = browser.get(f"{stack.base}/builds/{build}/log.txt", timeout=30)
    assert log.status_code == 200 and log.headers["Content-Type"].startswith("text/plain") and log.text.strip()


def fleet_engineer(stack: Stack, token: str, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/fleet.md: fetch, the signature checks (model-signing's verifier and compilesvc verify), serving."""
    host = user(stack, tmp_path / "fleet", token, **{TRUSTED_KEYS_ENV: str(stack.public_key)})
    fetch = fill(doc_block("fleet.md", "## `compilesvc fetch`").splitlines()[0], {"KEY": key})
    directory = Path(host.run(fetch, timeout=180).stdout.strip())
    assert directory == host.cwd / "cache" / "compilesvc" / "v1" / "artifacts" / key, directory
    # docs/api.md's lookup, as a fleet without the CLI makes it: the URLs are the store's (presigned on S3).
    lookup = fill(doc_block("api.md", "## Fetching artifacts (serving fleets)"),
                  {"0c02fae24be4d2e40c63d9dd69bc7aab94fc67b7dd588f20a0cafafb995ff5b2": key})
    manifest = json.loads(host.run(lookup, API=stack.base).stdout)
    urls = [file["url"] for bucket in manifest["buckets"] for file in bucket["files"]]
    assert manifest["key"] == key and urls and all(url.startswith(stack.downloads) for url in urls), urls
    shutil.copy(stack.public_key, host.cwd / "compilesvc.pub.pem")  # the file the block names
    signed = host.run(fill(doc_block("fleet.md", "so the standard verifier works on the directory as it is"),
                           {"KEY": key}), timeout=180)
    assert (host.cwd / "artifact" / "model.sig").is_file(), signed.stderr
    untrusting = host.run(f"compilesvc verify {key} --offline", check=False, **{TRUSTED_KEYS_ENV: ""})
    assert untrusting.returncode == 3, untrusting.stderr  # no trusted key: refused, as fleet.md says

    import torch  # the serving code's models take tensors

    scope: dict[str, Any] = {"KEY": key, "TooLarge": ValueError, "tokenizer": SimpleNamespace(pad_token_id=0)}
    for name, value in host.env.items():  # ArtifactSet.open reads the serving host's environment
        monkeypatch.setenv(name, value)
    exec(doc_block("fleet.md", "one place that imports torch.", lang="python"), scope)
    for batch, seq in ((1, 100), (3, 128)):  # padded into the bucket that fits, then cropped back
        ids = torch.randint(1, 100, (batch, seq))
        assert tuple(scope["infer"](ids, torch.ones_like(ids)).shape) == (batch, 4)
    with pytest.raises(ValueError, match="largest compiled is 128"):
        scope["infer"](torch.ones(1, 129, dtype=torch.int64), torch.ones(1, 129, dtype=torch.int64))


def operator_checks(stack: Stack, tmp_path: Path) -> None:
    """docs/deploy.md "Retention" (the dry run) and docs/neuron-hosts.md's doctor, on this host (no Neuron)."""
    dry_run = doc_block("deploy.md", "## Retention").splitlines()[0]
    assert dry_run.split("#")[0].strip() == "compilesvc gc --dry-run", dry_run
    gc = stack.server().run(dry_run)
    # Everything here is younger than RETENTION_MIN_AGE_DAYS: nothing would go.
    assert re.match(r"gc run \d+ \(dry run\): would delete 0 artifact\(s\)", gc.stdout), gc.stdout + gc.stderr
    doctor = doc_block("neuron-hosts.md", "It needs no database").splitlines()[1]
    assert doctor.endswith("compilesvc doctor"), doctor
    report = Shell({**clean_env(), "HOME": str(tmp_path)}, tmp_path).run(doctor, check=False, timeout=120)
    assert report.returncode == 1, report.stdout + report.stderr  # docs: 1 a check failed
    assert report.stdout.startswith("compilesvc doctor: FAIL"), report.stdout
    assert "This host has no Neuron toolchain" in report.stdout and "serves the cpu target" in report.stdout
    assert re.search(r"^SKIP +trace +no Neuron toolchain", report.stdout, re.M), report.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["embedded", "full"])
def test_first_hour(kind: str, request: pytest.FixtureRequest, tiny_torch_model: Path, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    stack_of = embedded(tmp_path) if kind == "embedded" else full(request, tmp_path, monkeypatch)
    with stack_of as stack:
        tokens = operator_makes_tokens(stack, tmp_path)
        if kind == "embedded":  # README: the CLI takes the token dev made from the data dir
            export = re.search(r"`(export COMPILESVC_TOKEN=\$\(cat \.compilesvc/admin-token\))`",
                               (ROOT / "README.md").read_text())
            assert export is not None, "README no longer says how to use dev's admin token"
            shell = stack.server()
            shell.env["COMPILESVC_API_URL"] = stack.base
            assert "compilesvc dev" in shell.run(f"{export[1]}\ncompilesvc tokens list").stdout
        job, spec, uri, build, hit, key = ci_engineer(stack, tokens["ci"], tiny_torch_model, tmp_path)
        missed = ci_exit_statuses(job, stack, spec, uri, key)
        ui_engineer(stack, tokens["ci"], build, hit, missed, key)
        fleet_engineer(stack, tokens["fleet"], key, tmp_path, monkeypatch)
        operator_checks(stack, tmp_path)
