"""COMPILESVC_SANDBOX=pod: the runner hands attempts to a real compile runner process (workers.isolation.compile_runner)
started here with a scrubbed environment, through a spool directory, as the two containers of a pod would.

The ledger is the real Postgres, the store a local one, the compiles real (torch for cpu, the Neuron TEST
DOUBLE's compiler for the rest), as in test_runner.py, whose fixtures these are.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from compilesvc.builds.control import cancel_build
from compilesvc.builds.submit import Submitter
from compilesvc.config.settings import Settings
from compilesvc.ledger.models import LogLine
from compilesvc.services import Services
from compilesvc.spec.manifest import parse_bucket_manifest
from compilesvc.spec.parsing import parse_spec
from compilesvc.store.base import bucket_manifest_name
from tests.attacks.payloads import Hostile
from tests.fixtures.ledger import empty_tables
from tests.fixtures.waiting import wait_for
from tests.workers.compiling.test_runner import WORKER, bucket, run_in_thread, services, submit  # noqa: F401 - fixture
from tests.workers.test_pipeline import processes_of
from workers.compiling.runner import run_compile, work_root
from workers.isolation.child_env import child_environment
from workers.isolation.sandbox import Policy
from workers.isolation.spool import ATTEMPTS, MODELS, RUN, STATUS, write_document
from workers.isolation.spool_process import SpoolUnavailable, probe

REPO = Path(__file__).resolve().parents[3]


#: The compile container, as far as a root test can build one: a PID namespace of its own with the runner as
#: PID 1, the root filesystem read-only except the spool's attempts and heartbeat, its models read-only, the
#: worker's own files (``$HIDE``) absent (an empty tmpfs over each), no CAP_SYS_ADMIN to undo any of it.
CONTAINER = """set -e
mount --make-rprivate /
for path in $HIDE; do mount -t tmpfs -o ro,size=4k none "$path"; done
for part in attempts runner models; do mkdir -p "$SPOOL/$part"; mount --bind "$SPOOL/$part" "$SPOOL/$part"; done
mount -o remount,bind,ro "$SPOOL/models"
mount -o remount,bind,ro /
exec setpriv --bounding-set=-sys_admin --inh-caps=-sys_admin "$@"
"""


class Runner:
    """A compile runner process, as the compile container's entry point."""

    def __init__(self, spool: Path, *, pid_namespace: bool = False, extra_env: dict[str, str] | None = None,
                 container_hiding: list[Path] | None = None, environ: dict[str, str] | None = None):
        # What a compile container's image gives it (PATH, locale, the Neuron double's variables), no more.
        scrubbed = child_environment(os.environ if environ is None else environ)
        env = {k: v for k, v in scrubbed.items() if k != "PYTHONUNBUFFERED"}
        env.update(extra_env or {})
        argv = [sys.executable, "-m", "workers.isolation.compile_runner", "--spool", str(spool)]
        if pid_namespace:  # the runner as PID 1 of its own PID namespace, as in its container
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]
        if container_hiding is not None:
            setup = {"SPOOL": str(spool), "HIDE": " ".join(str(p) for p in container_hiding)}
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--", "sh", "-c", CONTAINER,
                    "container", *argv]
            env = {**env, **setup}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


@pytest.fixture
def pod(services: Services, spool: Path) -> Iterator[Services]:  # noqa: F811 - the fixture above
    services.settings.sandbox = "pod"
    services.settings.compile_spool = spool
    services.settings.compile_runner_pickup_seconds = 10
    services.settings.compile_runner_stale_seconds = 3
    yield services


@pytest.fixture
def runner(spool: Path) -> Iterator[Runner]:
    started = Runner(spool)
    yield started
    started.kill()


def torchscript_submit(services: Services, tmp_path: Path, module: object, name: str) -> int:  # noqa: F811
    import torch

    path = tmp_path / f"{name}.pt"
    if not path.exists():  # saved once: the same bytes, the same key, in either mode
        torch.jit.save(torch.jit.script(module), str(path))
    uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    result = Submitter(services).submit(parse_spec({
        "model": {"uri": uri, "format": "torchscript"}, "target": "cpu", "sdk": "2.13.0",
        "compiler": {"backend": "torchscript"}, "buckets": [{"batch_size": 1, "seq_len": 16}],
    }))
    return bucket(services, result).id


def tiny_module() -> object:
    import torch

    class Tiny(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return input_ids * attention_mask + 1

    return Tiny()


def published_files(services: Services, bucket_id: int) -> list[tuple[str, str]]:  # noqa: F811
    from compilesvc.ledger.models import BucketCompile

    with services.sessions() as session:
        key = session.get(BucketCompile, bucket_id).key  # type: ignore[union-attr]
    manifest = parse_bucket_manifest(services.store.read_document(bucket_manifest_name(key)), key)
    return sorted((f.path, f.sha256) for f in manifest.files)


def spool_is_empty(spool: Path) -> bool:
    return not any((spool / ATTEMPTS).iterdir()) and not any((spool / MODELS).iterdir())


def test_a_cpu_compile_publishes_what_the_bubblewrap_mode_publishes(pod: Services, runner: Runner, spool: Path,
                                                                  tmp_path: Path, pg_url: str) -> None:
    row = torchscript_submit(pod, tmp_path, tiny_module(), "tiny")
    outcome = run_compile(pod, row, WORKER)
    assert outcome.status == "succeeded", outcome
    in_pod = published_files(pod, row)
    with pod.sessions() as session:
        lines = list(session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == row)))
    assert any("[compile-child] ok" in line for line in lines)  # the runner's log reached the ledger
    assert spool_is_empty(spool) and list(work_root().iterdir()) == []

    empty_tables(pg_url)  # the same compile again, in a fresh ledger and store, sandboxed by bubblewrap
    settings = Settings(**{**pod.settings.model_dump(), "sandbox": "bwrap",
                           "store_url": (tmp_path / "store-bwrap").as_uri()})
    bwrap = Services.from_settings(settings)
    try:
        again = torchscript_submit(bwrap, tmp_path, tiny_module(), "tiny")
        assert run_compile(bwrap, again, WORKER).status == "succeeded"
        assert published_files(bwrap, again) == in_pod
    finally:
        bwrap.close()


def test_cancel_stops_the_compile(pod: Services, runner: Runner, spool: Path,
                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    result = submit(pod, "slow:60")
    row = bucket(pod, result)
    thread, out = run_in_thread(pod, row.id)
    deadline = time.monotonic() + 30
    while not [r for r in caplog.records if r.getMessage() == "compiler started"] and time.monotonic() < deadline:
        time.sleep(0.1)
    job = str(next(r for r in caplog.records if r.getMessage() == "compiler started").job_dir)  # type: ignore[attr-defined]
    while not processes_of(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(job)  # the runner's child, in the spool's attempt
    cancel_build(pod, result.build_id)
    thread.join(30)
    assert out and out[0].status == "cancelled"
    assert processes_of(job) == [] and spool_is_empty(spool)


def test_a_timeout_is_classified_as_now(pod: Services, runner: Runner) -> None:
    pod.settings.compile_timeout_seconds = 2
    row = bucket(pod, submit(pod, "slow:60"))
    outcome = run_compile(pod, row.id, WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("queued", "timeout", "TIMEOUT")


def test_output_and_disk_limits_are_the_compiles(pod: Services, runner: Runner, tmp_path: Path) -> None:
    import torch

    class Loud(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            for _ in range(1_000_000):
                print("compile output that goes on and on and on and on and on and on and on and on and on")
            return input_ids * attention_mask

    pod.settings.sandbox_max_log_mb = 1
    outcome = run_compile(pod, torchscript_submit(pod, tmp_path, Loud(), "loud"), WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("failed", "compile", "SANDBOX_OUTPUT_LIMIT")
    pod.settings.sandbox_max_disk_mb = 8
    pod.settings.sandbox_max_log_mb = 256
    filler = Hostile("fill", size=1024 * 1024, count=16)  # tests/attacks' disk filler: 16 MiB, then spins
    outcome = run_compile(pod, torchscript_submit(pod, tmp_path, filler, "filler"), WORKER)
    assert (outcome.error_class, outcome.code) == ("compile", "SANDBOX_DISK_LIMIT"), outcome


def test_a_runner_killed_mid_attempt_is_an_infra_failure_that_is_retried(pod: Services, spool: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    runner = Runner(spool)
    try:
        row = bucket(pod, submit(pod, "slow:60"))
        thread, out = run_in_thread(pod, row.id)
        deadline = time.monotonic() + 30
        while not list(spool.glob(f"{ATTEMPTS}/*/{RUN}/compile.log")) and time.monotonic() < deadline:
            time.sleep(0.1)
        runner.kill()
        thread.join(60)
    finally:
        runner.kill()
    assert out and (out[0].status, out[0].error_class, out[0].code) == ("queued", "infra", "COMPILE_RUNNER_LOST")
    assert bucket(pod, submit(pod, "slow:60")).attempts == 1  # queued again for another attempt


def test_a_runner_nobody_answers_refuses_the_worker(pod: Services, spool: Path) -> None:
    policy = Policy.from_settings(pod.settings)
    with pytest.raises(SpoolUnavailable, match="never wrote its heartbeat"):
        probe(spool, policy.limits, pickup_seconds=1, stale_seconds=1)
    assert spool_is_empty(spool)


def test_the_runner_refuses_to_start_with_secrets_in_its_environment(spool: Path) -> None:
    for name, value in (("COMPILESVC_DATABASE_URL", "postgresql://svc:ledger-pw@db/x"),
                        ("AWS_SECRET_ACCESS_KEY", "aws-secret-value"),
                        ("COMPILESVC_BOOTSTRAP_TOKEN", "csvc_bootstrap-secret"),
                        ("COMPILESVC_SIGNING_KEY_FILE", "/secret/signing.pem")):
        runner = Runner(spool, extra_env={name: value})
        output, _ = runner.proc.communicate(timeout=60)
        assert runner.proc.returncode == 78
        assert name in output.decode() and value not in output.decode()


def test_the_worker_probe_passes_with_a_runner(pod: Services, runner: Runner, spool: Path) -> None:
    probe(spool, Policy.from_settings(pod.settings).limits, pickup_seconds=10, stale_seconds=3)
    assert spool_is_empty(spool)


@pytest.mark.parametrize("pid_namespace", [False, True], ids=["process-group", "pid-1"])
def test_a_compile_leaves_no_process_behind(pod: Services, spool: Path, pid_namespace: bool) -> None:
    """The double's compiler starts a process that outlives it: in the child's group (the runner kills the
    group), or in a session of its own (only the runner as PID 1 of its namespace reaches that one)."""
    runner = Runner(spool, pid_namespace=pid_namespace)
    try:
        behaviour = "linger:session" if pid_namespace else "linger:group"
        row = bucket(pod, submit(pod, behaviour))
        outcome = run_compile(pod, row.id, WORKER)
        assert outcome.status == "succeeded", outcome
        assert processes_of("double-linger") == []
    finally:
        runner.kill()


def test_a_link_left_as_result_or_output_is_not_followed(pod: Services, runner: Runner, spool: Path,
                                                         tmp_path: Path) -> None:
    """A compile that swaps its output for a link to a file only the worker has: nothing of it is published."""
    secret = tmp_path / "worker-secret"
    secret.write_text("worker-only secret")
    import torch

    class Swap(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return input_ids * attention_mask

    row = torchscript_submit(pod, tmp_path, Swap(), "swap")
    # Stand in for a compile that replaces its output with a link once it wrote result.json (the runner
    # reports only after the child exited, so the link is there when the worker reads).
    import threading

    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for result in spool.glob(f"{ATTEMPTS}/*/work/result.json"):
                for out in result.parent.parent.joinpath("out").iterdir():
                    if not out.is_symlink():
                        out.unlink()
                        out.symlink_to(secret)
            time.sleep(0.01)

    watcher = threading.Thread(target=swap, daemon=True)
    watcher.start()
    try:
        outcome = run_compile(pod, row, WORKER)
    finally:
        stop.set()
        watcher.join(5)
    assert (outcome.status, outcome.code) == ("failed", "BAD_OUTPUT"), outcome
    assert "worker-only secret" not in (outcome.message or "")


def test_a_forged_status_link_is_not_followed(spool: Path, tmp_path: Path) -> None:
    from workers.isolation.spool import read_document

    target = tmp_path / "elsewhere.json"
    write_document(target, {"returncode": 0})
    link = tmp_path / STATUS
    link.symlink_to(target)
    assert read_document(link) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="building the compile container's mounts takes root")
def test_tests_attacks_models_through_the_pod_find_nothing_and_write_nothing(
        pod: Services, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile models of tests/attacks, compiled through a runner in a stand-in for its container: the
    worker's environment and files are not there to read, and nothing outside the attempt can be written."""
    worker_only = tmp_path / "worker-only"
    worker_only.mkdir()
    token = worker_only / "admin-token"
    token.write_text("csvc_admin-token-secret-of-the-worker")
    monkeypatch.setenv("COMPILESVC_DATABASE_URL", "postgresql://svc:ledger-password-secret@db/compilesvc")
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    store = tmp_path / "store"
    hidden = [worker_only, store, pod.settings.data_dir]
    for path in hidden:
        path.mkdir(exist_ok=True)
    runner = Runner(spool, container_hiding=hidden)
    try:
        attacks = {
            "read-worker-file": Hostile("read", str(token), 36),
            "read-via-worker-proc-root": Hostile("read", f"/proc/{os.getpid()}/root{token}", 36),
            "read-via-worker-proc-cwd": Hostile("read", f"/proc/{os.getpid()}/cwd/README.md", 16),
            "write-outside-the-attempt": Hostile("write", str(outside), 9),
            "write-the-store": Hostile("write", str(next(store.rglob("*.pt"), store / "blobs" / "x")), 16),
        }
        for name, model in attacks.items():
            outcome = run_compile(pod, torchscript_submit(pod, tmp_path, model, name), WORKER)
            assert (outcome.status, outcome.error_class) == ("failed", "compile"), (name, outcome)
            for secret in ("admin-token-secret", "ledger-password-secret"):
                assert secret not in (outcome.message or ""), name
        assert outside.read_text() == "untouched"
        with pod.sessions() as session:
            logged = "\n".join(session.scalars(select(LogLine.line)))
        assert "admin-token-secret" not in logged and "ledger-password-secret" not in logged
    finally:
        runner.kill()


def test_a_worker_in_pod_mode_refuses_to_start_without_a_runner_and_compiles_with_one(
        make_cluster: Any, spool: Path) -> None:
    """The real `compilesvc worker` (Postgres ledger, Redis broker): exit 78 when no runner answers its
    probe; beside a runner, it takes a submitted compile and publishes it."""
    cluster = make_cluster(sandbox="pod", compile_spool=str(spool), compile_runner_pickup_seconds=2,
                           compile_runner_stale_seconds=3)
    alone = cluster.start_worker("alone", concurrency=1, wait=False)
    assert alone.proc.wait(60) == 78
    assert "compile runner does not answer" in alone.log_path.read_text()
    runner = Runner(spool, environ=cluster.env)
    try:
        worker = cluster.start_worker("pod", concurrency=1)
        assert worker.logged("compile runner ready")
        result = cluster.submit(cluster.hlo_spec())
        done = cluster.wait_bucket(result.buckets[0].key, ("succeeded", "failed"), timeout=90)
        assert done.state == "succeeded", done.error_message
        wait_for(lambda: spool_is_empty(spool), 30, "the worker to wipe the attempt")  # after it recorded it
    finally:
        runner.kill()


def test_the_probe_says_how_many_neuron_devices_the_compile_container_has(pod: Services, spool: Path,
                                                                          tmp_path: Path) -> None:
    limits = Policy.from_settings(pod.settings).limits
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for index in range(2):
        (nodes / f"neuron{index}").touch()
    runner = Runner(spool, extra_env={"COMPILESVC_NEURON_DEVICE_GLOB": str(nodes / "neuron[0-9]*")})
    try:
        assert probe(spool, limits, pickup_seconds=10, stale_seconds=3) == 2
    finally:
        runner.kill()
    bare = Runner(spool, extra_env={"COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "none" / "neuron[0-9]*")})
    try:
        assert probe(spool, limits, pickup_seconds=10, stale_seconds=3) == 0
    finally:
        bare.kill()


def test_a_pod_split_worker_offers_what_its_compile_containers_devices_allow(
        make_cluster: Any, spool: Path, tiny_torch_model: Path, tmp_path: Path) -> None:
    """The Helm chart gives a device pool's Neuron devices to the compile container, not the worker's: the real
    `compilesvc worker` in pod mode registers the runner's device count (its probe), so it offers a 2.19 trace
    (which needs a device; compilesvc.spec.neuron_kinds.device_requirement) and the compile runs beside it."""
    from compilesvc.dispatch.registry import live_workers
    from compilesvc.dispatch.routing import queue_name
    from tests.doubles import neuron_double_env, with_devices

    release = "2.19.0"
    cluster = make_cluster(sandbox="pod", compile_spool=str(spool), compile_runner_pickup_seconds=10,
                           compile_runner_stale_seconds=5)
    worker_env = neuron_double_env(cluster.env, sdk=release, devices=0)
    worker_env["COMPILESVC_NEURON_DEVICE_GLOB"] = str(tmp_path / "none" / "neuron[0-9]*")  # no device here
    runner = Runner(spool, environ=with_devices(worker_env, tmp_path, 1))  # the compile container's device
    try:
        cluster.start_worker("pod", concurrency=1, env=worker_env)
        with cluster.services.sessions() as session:
            [registered] = live_workers(session, cluster.settings.worker_stale_seconds)
        queue = queue_name("inf2", release, "trace")
        assert registered.capabilities["neuron"]["devices"] == 1 and queue in registered.queues
        uri = cluster.upload(tiny_torch_model.read_bytes(), "tiny.pt2")
        result = cluster.submit({"model": {"uri": uri, "format": "exported-program", "name": "tiny"},
                                 "target": "inf2", "sdk": release, "buckets": [{"batch_size": 1, "seq_len": 8}]})
        bucket = cluster.wait_bucket(result.buckets[0].key, ("succeeded", "failed"), timeout=150)
        assert bucket.state == "succeeded", bucket.error_message
        assert (bucket.queue, bucket.versions["trace_lowering"]) == (queue, "device")
    finally:
        runner.kill()
