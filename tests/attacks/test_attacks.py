"""Hostile models through the real API, on both stacks; see the package docstring for what must hold."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.attacks.payloads import MIB, Attack, Hostile, model_bytes, printable, read, write
from tests.attacks.stack import KINDS, LIMITS, Stack, running_stack, secret_file_paths
from tests.fixtures.waiting import wait_for

#: A file every compile may read (the toolchain), at the same path inside the sandbox: the channels' control.
TORCH_VERSION_FILE = Path(str(torch.__file__)).parent / "version.py"
CONTROL_BYTES = 120
FINISHED = ("succeeded", "failed", "cancelled")
RUNNING_WRITES = ("write-running-compile-request", "write-running-compile-model")


@dataclass
class Context:
    """What the attacks aim at, known once the victim published and the long compile runs."""

    stack: Stack
    victim_key: str
    victim_files: dict[str, Path]  # store files of the victim's artifact and upload (local store only)
    running_job: Path  # the job directory of the attacker's own endless compile, running meanwhile
    canary: Path  # a file the test planted in the toolchain (the interpreter's environment), readable by all
    private_keys: list[Path]  # private keys in the data dir (the key that signs what the worker publishes)


def _size(path: Path) -> int:
    return path.stat().st_size


def _first(path: Path, limit: int = 4096) -> int:
    return min(_size(path), limit)


#: Every attack by name: what it targets, built once the targets exist. None: not in this layout.
ATTACKS: dict[str, Callable[[Context], Attack | None]] = {
    # -- writes into the attacker's own endless compile (run-past-time-limit), submitted first ----------
    "write-running-compile-request": lambda c: write("request", str(c.running_job / "request.json"), 8),
    "write-running-compile-model": lambda c: write("model", str(c.running_job / "model" / "model.pt"), 8),
    # -- the channels work: the same reads of a file the sandbox shows do come out ------------------------
    "control-read-toolchain-to-error": lambda c: read("control-error", str(TORCH_VERSION_FILE), CONTROL_BYTES),
    "control-read-toolchain-to-artifact": lambda c: read("control-artifact", str(TORCH_VERSION_FILE),
                                                         CONTROL_BYTES, "artifact"),
    # -- reads ---------------------------------------------------------------------------------------------
    "read-admin-token": lambda c: _embedded(c, "admin token", "error"),
    "read-admin-token-to-artifact": lambda c: _embedded(c, "admin token", "artifact"),
    "read-url-signing-key": lambda c: _embedded(c, "secret key", "error"),
    "read-ledger-file": lambda c: _embedded(c, "ledger", "error"),
    "read-aws-credentials-file": lambda c: read(
        "aws", str(secret_file_paths(c.stack)["credentials"]), _size(secret_file_paths(c.stack)["credentials"])),
    "read-proc-self-environ": lambda c: read("self-environ", "/proc/self/environ", 64),
    "read-proc-1-environ": lambda c: read("init-environ", "/proc/1/environ", 64),
    "read-worker-environ": lambda c: read("worker-environ", f"/proc/{c.stack.worker.proc.pid}/environ", 64),
    # /proc files have no size (from_file cannot map them), but /proc/<pid>/cwd and /root lead to real files.
    "read-admin-token-via-worker-cwd": lambda c: _embedded(
        c, "admin token", "error", via=f"/proc/{c.stack.worker.proc.pid}/cwd/data/admin-token"),
    "read-credentials-via-worker-root": lambda c: read(
        "worker-root", f"/proc/{c.stack.worker.proc.pid}/root{secret_file_paths(c.stack)['credentials']}",
        _size(secret_file_paths(c.stack)["credentials"])),
    "read-signing-key": lambda c: (read("signing-key", str(c.private_keys[0]), _first(c.private_keys[0]))
                                   if c.private_keys else None),
    "read-victim-upload": lambda c: _victim(c, "upload", "read"),
    "read-victim-artifact-file": lambda c: _victim(c, "model.pt", "read"),
    "read-victim-manifest": lambda c: _victim(c, "manifest", "read"),
    # -- writes --------------------------------------------------------------------------------------------
    "write-victim-manifest": lambda c: _victim(c, "manifest", "write"),
    "write-victim-artifact-file": lambda c: _victim(c, "model.pt", "write"),
    "write-victim-upload": lambda c: _victim(c, "upload", "write"),
    "write-worker-credentials-file": lambda c: write(
        "creds", str(secret_file_paths(c.stack)["credentials"]), 16),
    # The toolchain is every later compile's code (and the worker's own): a write there would outlive the compile.
    "write-toolchain-file": lambda c: write("toolchain", str(c.canary), 16),
    "write-signing-key": lambda c: write("signing-key", str(c.private_keys[0]), 16) if c.private_keys else None,
    "write-ledger-file": lambda c: (write("ledger", str(c.stack.ledger_file), 16)
                                    if c.stack.ledger_file else None),
    # -- limits --------------------------------------------------------------------------------------------
    "run-past-time-limit": lambda c: Attack("loop", Hostile("loop"), frozenset({"timeout"})),
    "allocate-past-memory-limit": lambda c: Attack(
        "alloc", Hostile("alloc", size=(LIMITS["sandbox_memory_mb"] + 1024) * MIB), code="SANDBOX_MEMORY_LIMIT"),
    "write-file-past-size-limit": lambda c: Attack(
        "bigfile", Hostile("fill", size=(LIMITS["sandbox_max_file_mb"] + 8) * MIB, count=1),
        code="SANDBOX_FILE_SIZE_LIMIT"),
    "fill-past-disk-limit": lambda c: Attack(
        "disk", Hostile("fill", size=(LIMITS["sandbox_max_file_mb"] - 4) * MIB, count=3), code="SANDBOX_DISK_LIMIT"),
}


def _embedded(c: Context, which: str, channel: str, via: str | None = None) -> Attack | None:
    paths = secret_file_paths(c.stack)
    if which not in paths:
        return None  # only the embedded default keeps it in a file on the worker's host
    return read(which, via or str(paths[which]), _first(paths[which]), channel)


def _victim(c: Context, which: str, how: str) -> Attack | None:
    path = c.victim_files.get(which)
    if path is None:
        return None  # the victim's bytes are in S3: no path on the worker's host names them
    return read(which, str(path), _first(path)) if how == "read" else write(which, str(path), 16)


@dataclass
class Outcome:
    attack: Attack
    build: dict[str, Any]
    answers: bytes  # everything the attacker's token got back about its build
    artifact_bytes: bytes = b""


@dataclass
class Campaign:
    stack: Stack
    victim_key: str
    victim_before: dict[str, str]
    victim_after: dict[str, str]
    host_before: dict[str, str]
    host_after: dict[str, str]
    running_before: dict[str, str]
    running_after: dict[str, str]
    #: Whether the endless compile still ran when the writes into its directory had finished.
    loop_was_running: bool
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    benign: dict[str, Any] = field(default_factory=dict)
    worker_alive: bool = False


def _digests(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "gone" for p in paths}


def _wait_build(stack: Stack, http: requests.Session, build_id: int, timeout: float) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        build = stack.build(http, build_id)
        return build if build["state"] in FINISHED else None

    return dict(wait_for(finished, timeout, f"build {build_id} to finish", interval=0.5))


def _answers(stack: Stack, build: dict[str, Any]) -> tuple[bytes, bytes]:
    """Every answer the attacker's token gets about its build: the build, its logs (API, UI page, log.txt),
    the artifact's manifest and every file it names; and the artifact files alone."""
    http, base, build_id = stack.attacker, stack.base, build["build_id"]
    parts = [json.dumps(build).encode()]
    for path in (f"/v1/builds/{build_id}/logs?after=0&limit=5000", f"/builds/{build_id}",
                 f"/builds/{build_id}/log.txt"):
        answer = http.get(base + path)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:500])
        parts.append(answer.content)
    files = b""
    if build["state"] == "succeeded":
        manifest = http.get(f"{base}/v1/artifacts/{build['artifact_key']}")
        assert manifest.status_code == 200, manifest.text
        parts.append(manifest.content)
        for bucket in manifest.json()["buckets"]:
            for entry in [*bucket["files"], bucket["log"]]:
                body = requests.get(entry["url"], timeout=30)
                assert body.status_code == 200, entry
                files += body.content
    for sha in set(re.findall(rb"archived as blob sha256:([0-9a-f]{64})", b"".join(parts))):
        blob = http.get(f"{base}/v1/blobs/{sha.decode()}")
        if blob.status_code == 200:
            parts.append(blob.content)
    return b"".join(parts) + files, files


def _victim_paths(stack: Stack, key: str, upload_sha: str) -> dict[str, Path]:
    root = stack.local_store
    if root is None:
        return {}
    manifest = stack.admin.get(f"{stack.base}/v1/artifacts/{key}").json()
    (model,) = [f for b in manifest["buckets"] for f in b["files"] if f["role"] == "model"]
    return {"manifest": root / "artifacts" / key / "manifest.json",
            "model.pt": root / "blobs" / "sha256" / model["sha256"][:2] / model["sha256"],
            "upload": root / "blobs" / "sha256" / upload_sha[:2] / upload_sha}


def run_campaign(stack: Stack, canary: Path) -> Campaign:
    # The victim team publishes an artifact; its model carries a marker that must never leak.
    marker = f"VICTIM-MARKER-{os.urandom(8).hex()}"
    stack.secrets["victim's model"] = marker
    if stack.kind == "embedded":
        stack.secrets["ledger header"] = "SQLite format 3"
    victim_model = model_bytes(Hostile("benign", marker=marker))
    victim = stack.submit(stack.victim, victim_model, "victim")
    finished = _wait_build(stack, stack.victim, victim["build_id"], 120)
    assert finished["state"] == "succeeded", finished
    key = finished["artifact_key"]
    victim_paths = _victim_paths(stack, key, hashlib.sha256(victim_model).hexdigest())
    victim_before = stack.artifact_files(key)
    host_files = [p for p in secret_file_paths(stack).values() if p.suffix != ".db"] + list(victim_paths.values())
    host_files.append(canary)
    # Whatever private key the data dir holds once a build was published (the publishing side's signing key).
    private_keys = [pem for pem in sorted(stack.data_dir.glob("*.pem")) if b"PRIVATE KEY" in pem.read_bytes()]
    for pem in private_keys:
        stack.secrets[f"private key {pem.name}"] = max(pem.read_text().splitlines(), key=len)
    host_files += private_keys
    host_before = _digests(host_files)
    ledger = stack.ledger_file

    # The attacker's endless compile: it runs while the others try to write into its directory.
    attacks: dict[str, Attack] = {}
    submitted: dict[str, int] = {}
    loop = ATTACKS["run-past-time-limit"](None)  # type: ignore[arg-type]
    assert loop is not None
    attacks["run-past-time-limit"] = loop
    submitted["run-past-time-limit"] = stack.submit(stack.attacker, model_bytes(loop.model), loop.name)["build_id"]
    job = wait_for(lambda: next(iter(stack.work_root.glob(f"job-*/{'request.json'}")), None), 60,
                   "the endless compile to start").parent
    running = [job / "request.json", job / "model" / "model.pt"]
    running_before = _digests(running)

    context = Context(stack, key, victim_paths, job, canary, private_keys)
    for name, build in ATTACKS.items():
        if name in attacks:
            continue
        attack = build(context)
        if attack is not None:
            attacks[name] = attack
            submitted[name] = stack.submit(stack.attacker, model_bytes(attack.model), attack.name)["build_id"]
    builds = {name: _wait_build(stack, stack.attacker, submitted[name], 120) for name in RUNNING_WRITES}
    running_after = _digests(running)
    loop_was_running = stack.build(stack.attacker, submitted["run-past-time-limit"])["state"] == "building"
    builds.update({name: _wait_build(stack, stack.attacker, build_id, 150) for name, build_id in submitted.items()})

    campaign = Campaign(stack, key, victim_before, stack.artifact_files(key), host_before, _digests(host_files),
                        running_before, running_after, loop_was_running)
    if ledger is not None:
        campaign.host_after["ledger header"] = ledger.read_bytes()[:16].hex()
        campaign.host_before["ledger header"] = b"SQLite format 3\x00".hex()
    for name, finished_build in builds.items():
        answers, files = _answers(stack, finished_build)
        campaign.outcomes[name] = Outcome(attacks[name], finished_build, answers, files)

    # The worker survived all of it and still compiles.
    campaign.worker_alive = stack.worker.proc.poll() is None
    benign = stack.submit(stack.attacker, model_bytes(Hostile("benign", marker=f"after-{time.time()}")), "after")
    campaign.benign = _wait_build(stack, stack.attacker, benign["build_id"], 120)
    return campaign


@pytest.fixture(scope="module", params=KINDS)
def campaign(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    s3 = request.getfixturevalue("s3_server") if request.param == "s3" else None
    with pytest.MonkeyPatch.context() as env:
        for name, value in (s3.env() if s3 is not None else {}).items():
            env.setenv(name, value)  # the test's own store client talks to the same S3
        with running_stack(request.param, tmp_path_factory.mktemp(f"attacks-{request.param}"), request,
                           s3) as stack, planted_canary() as canary:
            yield run_campaign(stack, canary)


@contextlib.contextmanager
def planted_canary() -> Iterator[Path]:
    """A file in the toolchain the sandbox binds (this interpreter's environment), mode 0644 like the rest."""
    canary = Path(sys.prefix) / f"compilesvc-attack-canary-{os.getpid()}-{os.urandom(4).hex()}.txt"
    canary.write_text("the toolchain, as installed\n")
    canary.chmod(0o644)
    try:
        yield canary
    finally:
        canary.unlink(missing_ok=True)


def _attack_failures(campaign: Campaign, name: str) -> list[str]:
    """What went wrong with one attack (nothing: it failed as it must, and leaked nothing)."""
    outcome = campaign.outcomes.get(name)
    if outcome is None:
        return []  # its target does not exist in this layout (the store is S3, no data dir holds secrets)
    build, attack = outcome.build, outcome.attack
    (bucket,) = build["buckets"]
    seen = f"{name}: build {build['build_id']} {build['state']} {bucket['error_class']} {bucket['error_code']}"
    if name.startswith("control-"):
        expected = TORCH_VERSION_FILE.read_bytes()[:CONTROL_BYTES]
        if name.endswith("error"):
            works = (bucket["error_code"] == "CPU_TRACE_ERROR" and printable(expected).encode() in outcome.answers)
        else:
            works = build["state"] == "succeeded" and expected in outcome.artifact_bytes
        return [] if works else [f"{seen}: the channel carries nothing out, so the attacks prove nothing"]
    problems = []
    if build["state"] == "succeeded":
        if not attack.may_succeed:
            problems.append(f"{seen}: the attack succeeded")
    elif build["state"] != "failed" or bucket["error_class"] not in attack.classes or (
            attack.code is not None and bucket["error_code"] != attack.code):
        problems.append(f"{seen}: expected {sorted(attack.classes)} {attack.code or ''} ({bucket['error_message']})")
    leaked = [what for what, value in campaign.stack.secrets.items() if value.encode() in outcome.answers]
    if leaked:
        problems.append(f"{seen}: {leaked} appear in the answers")
    return problems


@pytest.mark.slow
def test_every_attack_fails_classified_and_leaks_nothing(campaign: Campaign) -> None:
    """One test per stack (not one per attack): pytest-xdist would spread per-attack tests over processes,
    and each process would start a stack and run the whole campaign again."""
    assert set(campaign.outcomes) >= {"control-read-toolchain-to-error", "run-past-time-limit",
                                      "write-running-compile-request", "fill-past-disk-limit"}
    problems = [problem for name in ATTACKS for problem in _attack_failures(campaign, name)]
    # The other team's artifact, the worker's files and the running compile's files are as they were.
    problems += [f"changed: {name}" for name, digest in campaign.victim_before.items()
                 if campaign.victim_after.get(name) != digest]
    problems += [f"changed: {name}" for name, digest in campaign.host_before.items()
                 if campaign.host_after.get(name) != digest]
    problems += [f"changed: {name} (of the running compile)" for name, digest in campaign.running_before.items()
                 if campaign.running_after.get(name) != digest]
    assert not problems, "\n".join(problems)
    assert campaign.loop_was_running, "the writes ran after the compile they aimed at had ended"
    assert "gone" not in campaign.running_before.values()
    # The worker survived all of it and still compiles.
    assert campaign.worker_alive, campaign.stack.worker.log_path.read_text()[-3000:]
    assert campaign.benign["state"] == "succeeded", campaign.benign
    assert campaign.stack.worker.proc.poll() is None
