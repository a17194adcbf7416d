"""The runner in-process, without Celery: real compile children (the Neuron TEST DOUBLE), a real Postgres
ledger, a local artifact store and kombu's filesystem broker in the test's directory."""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, update

from compilesvc.builds.control import cancel_build
from compilesvc.builds.submit import SubmitResult, Submitter
from compilesvc.compiles import failures
from compilesvc.compiles.reaper import reap
from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import make_sessionmaker
from compilesvc.ledger.models import Artifact, BucketCompile, Event, LogLine, Outbox, utcnow
from compilesvc.services import Services
from compilesvc.signing.artifacts import verify_artifact
from compilesvc.signing.keys import TrustedKeys
from compilesvc.spec.manifest import BucketManifest, FileEntry, parse_artifact_manifest, parse_bucket_manifest
from compilesvc.spec.parsing import parse_spec
from compilesvc.store.base import artifact_manifest_name, artifact_signature_name, blob_name, bucket_manifest_name
from tests.doubles import BEHAVIOUR_ENV, neuron_double_env
from tests.doubles.compiler_flags import DOUBLE_AND_REJECTED_FLAGS
from tests.doubles.neuron._release import RELEASES
from tests.workers.test_pipeline import processes_of
from workers.compiling.failure_table import TABLE
from workers.compiling.logstream import LogStream
from workers.compiling.runner import (
    OWNER_LOCK,
    ClaimNotRecorded,
    RunResult,
    run_compile,
    sweep_orphaned_attempts,
    work_root,
)
from workers.isolation.child_env import child_environment

WORKER = "runner-test@host"


@pytest.fixture
def services(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    double = neuron_double_env(sdk="2.27.1")  # the release submit()'s specs name
    for name in ("PYTHONPATH", "PATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE"):
        monkeypatch.setenv(name, double[name])  # the compile child finds the double
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # this test's own work root
    (tmp_path / "tmp").mkdir()
    services = Services.from_settings(Settings(
        data_dir=tmp_path / "data", database_url=pg_url, store_url=(tmp_path / "store").as_uri(),
        broker_url="filesystem://", secret_key="k", require_live_worker=False, allow_file_models=True,
        lease_seconds=3, heartbeat_seconds=0.5, max_attempts=2, compile_timeout_seconds=60,
    ))
    yield services
    services.close()


def submit(services: Services, behaviour: str = "ok", *, uri: str | None = None,
           args: list[str] | None = None, model_format: str = "hlo", sdk: str = "2.27.1") -> SubmitResult:
    if uri is None:
        path = services.settings.data_dir / "model.hlo.pb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"hlo bytes")
        uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    return Submitter(services).submit(parse_spec({
        "model": {"uri": uri, "format": model_format}, "target": "inf2", "sdk": sdk,
        "compiler": {"args": args if args is not None else [f"--double-behaviour={behaviour}"]},
        "buckets": [{"batch_size": 1, "seq_len": 16}],
    }, extra_flags=DOUBLE_AND_REJECTED_FLAGS))


def bucket(services: Services, result: SubmitResult) -> BucketCompile:
    with services.sessions() as session:
        return session.scalars(select(BucketCompile).where(BucketCompile.key == result.buckets[0].key)).one()


def run_in_thread(services: Services, bucket_id: int) -> tuple[threading.Thread, list[RunResult]]:
    out: list[RunResult] = []
    thread = threading.Thread(target=lambda: out.append(run_compile(services, bucket_id, WORKER)))
    thread.start()
    return thread, out


def wait_compiling(services: Services, bucket_id: int, caplog: pytest.LogCaptureFixture) -> str:
    """Wait until the compiler prints progress; return its attempt's job directory."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with services.sessions() as session:
            progress = session.scalar(select(func.count()).select_from(LogLine).where(
                LogLine.bucket_compile_id == bucket_id, LogLine.line.contains("progress: pass")))
        started = [r for r in caplog.records if r.getMessage() == "compiler started"]
        if progress and started:
            return str(started[-1].job_dir)
        time.sleep(0.1)
    raise AssertionError("the compiler never got going")


def test_child_environment_keeps_only_what_compilers_need() -> None:
    env = child_environment({
        "PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x",
        "NEURON_CC_FLAGS": "--cache_dir=/c", "NEURON_RT_VISIBLE_CORES": "0", "TORCHINDUCTOR_CACHE_DIR": "/t",
        "TORCH_HOME": "/th", "COMPILESVC_NEURON_SDK": "2.20.0",
        "COMPILESVC_DATABASE_URL": "postgresql://u:pw@db/x", "COMPILESVC_SECRET_KEY": "s",
        "COMPILESVC_BROKER_URL": "redis://:pw@r/0", "DATABASE_URL": "postgres://u:pw@db", "REDIS_URL": "redis://x",
        "CELERY_BROKER_URL": "redis://x", "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_SESSION_TOKEN": "t", "NEURON_SECRET_TOKEN": "t", "GITHUB_TOKEN": "t", "PGPASSWORD": "pw",
    })
    assert env == {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x",
                   "NEURON_CC_FLAGS": "--cache_dir=/c", "NEURON_RT_VISIBLE_CORES": "0",
                   "TORCHINDUCTOR_CACHE_DIR": "/t", "TORCH_HOME": "/th", "COMPILESVC_NEURON_SDK": "2.20.0",
                   "PYTHONUNBUFFERED": "1"}


def test_success_publishes_files_log_and_manifest(services: Services) -> None:
    result = submit(services)
    row = bucket(services, result)
    outcome = run_compile(services, row.id, WORKER)
    assert (outcome.status, outcome.attempt) == ("succeeded", 1)
    assert list(work_root().iterdir()) == []  # the attempt cleaned up after itself

    store = services.store
    raw = store.read_document(bucket_manifest_name(row.key))
    assert raw is not None
    manifest = parse_bucket_manifest(raw, row.key)
    assert manifest.worker == WORKER and manifest.inputs == row.inputs and manifest.material == row.material
    assert [f.role for f in manifest.files] == ["model"] and manifest.versions
    assert manifest.log is not None
    log_text = b"".join(store.iter_blob(manifest.log.sha256)).decode()
    assert "[neuronx-cc]" in log_text and "[compilesvc] attempt 1 of 2" in log_text
    done = bucket(services, result)
    assert (done.state, done.manifest_uri, done.worker_id) == ("succeeded", outcome.manifest_uri, WORKER)
    assert done.versions == manifest.versions
    with services.sessions() as session:
        artifact = session.scalars(select(Artifact)).one()
        assert artifact.state == "published"
        streams = session.execute(select(LogLine.stream, func.count()).where(LogLine.bucket_compile_id == row.id)
                                  .group_by(LogLine.stream)).all()
    assert {stream for stream, n in streams if n} == {"compiler", "service"}
    # The worker (trusted, after the child exited) signed the set it published, with its key.
    signer = services.signer
    assert signer is not None
    published = parse_artifact_manifest(store.read_document(artifact_manifest_name(artifact.key)) or b"",
                                        artifact.key)
    bundle = store.read_document(artifact_signature_name(artifact.key)) or b""
    trusted = TrustedKeys({signer.key.key_id: signer.key.public_key})
    assert verify_artifact(trusted, bundle, published).key_id == signer.key.key_id


def test_nothing_to_claim_runs_nothing(services: Services, caplog: pytest.LogCaptureFixture) -> None:
    result = submit(services)
    row = bucket(services, result)
    assert run_compile(services, row.id, WORKER).status == "succeeded"
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    assert run_compile(services, row.id, WORKER).status == "nothing-to-claim"
    assert [r for r in caplog.records if r.getMessage() == "duplicate delivery: nothing to claim"]
    assert bucket(services, result).attempts == 1


def test_cancel_kills_the_compiler_process_group(services: Services, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    result = submit(services, "slow:30")
    row = bucket(services, result)
    thread, out = run_in_thread(services, row.id)
    job = wait_compiling(services, row.id, caplog)
    assert len(processes_of(job)) >= 3  # bubblewrap, the child and the compiler it started
    started = time.monotonic()
    cancel_build(services, result.build_id)
    thread.join(15)
    assert out and out[0].status == "cancelled" and time.monotonic() - started < 6
    assert processes_of(job) == []
    assert list(work_root().iterdir()) == []
    assert bucket(services, result).state == "cancelled"


def test_a_lost_lease_stops_the_attempt_and_writes_nothing(services: Services,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    result = submit(services, "slow:30")
    row = bucket(services, result)
    thread, out = run_in_thread(services, row.id)
    job = wait_compiling(services, row.id, caplog)
    with services.sessions.begin() as session:  # the worker looks dead to the reaper...
        session.execute(update(BucketCompile).where(BucketCompile.id == row.id)
                        .values(lease_expires_at=utcnow()))
    assert reap(services).requeued == [row.id]  # ...which takes the compile back
    thread.join(15)
    assert out and out[0].status == "lease-lost"
    assert processes_of(job) == []
    after = bucket(services, result)
    assert (after.state, after.attempts, after.error_class) == ("queued", 1, None)  # the runner wrote nothing
    with services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Event).where(
            Event.entity == "bucket", Event.to_state.in_(["failed", "succeeded", "cancelled"]))) == 0


def test_timeout_is_recorded_and_requeued(services: Services) -> None:
    services.settings.compile_timeout_seconds = 1
    result = submit(services, "slow:30")
    row = bucket(services, result)
    started = time.monotonic()
    outcome = run_compile(services, row.id, WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("queued", "timeout", "TIMEOUT")
    assert time.monotonic() - started < 10
    with services.sessions() as session:
        requeue = session.scalars(select(Outbox).where(Outbox.bucket_compile_id == row.id).order_by(Outbox.id)).all()
    # The requeue waits out its backoff in the ledger (not in the broker), then the relay sends it.
    assert len(requeue) == 2 and requeue[-1].sent_at is None and requeue[-1].available_at is not None
    wait = (requeue[-1].available_at - requeue[-1].created_at).total_seconds()
    base = services.settings.retry_backoff_seconds
    assert base / 2 <= wait <= base + 1
    assert bucket(services, result).attempts == 1


def test_without_a_backoff_the_worker_relays_its_own_requeue(services: Services) -> None:
    services.settings.compile_timeout_seconds = 1
    services.settings.retry_backoff_seconds = 0
    result = submit(services, "slow:30")
    row = bucket(services, result)
    assert run_compile(services, row.id, WORKER).status == "queued"
    with services.sessions() as session:
        requeue = session.scalars(select(Outbox).where(Outbox.bucket_compile_id == row.id).order_by(Outbox.id)).all()
    assert len(requeue) == 2 and requeue[-1].sent_at is not None


# Every row of workers.compiling.failure_table.TABLE through the runner and the real child against the double. A
# case's id is its row's name, or "<row>/<variant>" (test_every_row_of_the_table_has_a_worker_path_test reads them).
# Compiler args of the spec; the final class and code; attempts it takes (max_attempts 3 here,
# unknown_failure_retries 1; None: retried, the count depends on the message repeating).
ROW_CASES = [
    pytest.param(["--double-behaviour=missing-lib"], "infra", "SHARED_LIBRARY", None, id="missing-shared-library"),
    pytest.param(["--double-behaviour=crash"], "infra", "COMPILER_KILLED", None, id="killed-by-signal"),
    pytest.param(["--double-behaviour=oom"], "infra", "COMPILER_KILLED", None, id="killed-by-signal/oom"),
    # neuronx-cc's own "[F137] … forcibly killed … insufficient system memory": the host's, retried.
    pytest.param(["--double-behaviour=f137"], "infra", "HOST_OOM", None, id="compiler-out-of-host-memory"),
    # The host's trouble behind the compiler's internal code ([INTERNAL_ERROR] [NCC_INLA001] Unhandled
    # exception with message: [Errno 28] …): retried, never negatively cached.
    pytest.param(["--double-behaviour=disk-full"], "infra", "DISK_FULL", None, id="disk-full"),
    pytest.param(["--double-behaviour=host-oom"], "infra", "HOST_OOM", None, id="host-out-of-memory"),
    pytest.param(["--double-behaviour=missing-module"], "infra", "MISSING_MODULE", None, id="missing-module"),
    pytest.param(["--double-behaviour=host-os-error"], "infra", "HOST_OS_ERROR", None, id="host-os-error"),
    pytest.param(["--no-such-flag"], "bad_request", "COMPILER_FLAG_REJECTED", 1, id="rejected-flag"),
    pytest.param(["--double-behaviour=ncc-error:NCC_EVRF007"], "compile", "NCC_EVRF007", 1, id="ncc-error-code"),
    pytest.param(["--double-behaviour=ncc-internal:NCC_IXCG856"], "compile", "NCC_IXCG856", 1, id="ncc-internal-code"),
    pytest.param(["--double-behaviour=bare-code:XTP002"], "compile", "XTP002", 1, id="bare-code"),
    # Control flow graph validation (compiler release notes 2.29.0). On 2.27.1, before the 2.31.0 fix of its
    # "non-deterministic compilation failures", the code is retried once, then final like any compile error.
    pytest.param(["--double-behaviour=ncc-error:NCC_CFG015"], "compile", "NCC_CFG015", 2, id="ncc-cfg-code"),
    # neuronx-cc reports an operator it cannot compile with a code (compiler/error-codes/EUOC002.rst); a
    # trace that cannot lower one raises with none: TRACE_ROW_CASES.
    pytest.param(["--double-behaviour=unsupported-op"], "compile", "NCC_EUOC002", 1,
                 id="ncc-error-code/unsupported-op"),
    pytest.param(["--double-behaviour=exit:70"], "unknown", "NEURONX_CC_EXIT_70", 2, id="unknown/exit-70"),
    pytest.param(["--double-behaviour=exit:1"], "unknown", "NEURONX_CC_EXIT_1", 2, id="unknown/exit-1"),
]


@pytest.mark.parametrize(("args", "error_class", "code", "attempts"), ROW_CASES)
def test_each_row_of_the_classification_table_through_the_runner(services: Services, args: list[str],
                                                                  error_class: str, code: str,
                                                                  attempts: int | None) -> None:
    """A compile runs through the runner and the real child against the double, attempt after attempt,
    until it is final: the class and code the table gives, retried exactly as its class says."""
    services.settings.max_attempts = 3
    services.settings.unknown_failure_retries = 1
    services.settings.retry_backoff_seconds = 0
    result = submit(services, args=args)
    row = bucket(services, result)
    outcomes = []
    for _ in range(4):  # bounded: never more attempts than max_attempts
        outcomes.append(run_compile(services, row.id, WORKER))
        if outcomes[-1].status != "queued":
            break
    assert outcomes[-1].status == "failed", outcomes
    assert {(o.error_class, o.code) for o in outcomes} == {(error_class, code)}, outcomes
    final = bucket(services, result)
    assert (final.state, final.error_class, final.error_code) == ("failed", error_class, code)
    if attempts is None:  # retried: at least once, never past the cap
        assert 2 <= final.attempts <= 3
    else:
        assert final.attempts == attempts
    if error_class == "unknown":
        assert final.error_message.startswith("no diagnosis after 2 unknown failure(s)")
    if error_class == "bad_request":
        assert "--no-such-flag" in final.error_message
    if code == "NCC_CFG015":
        assert "again after one retry" in final.error_message
    with services.sessions() as session:
        archived = session.scalars(select(LogLine.line).where(LogLine.line.startswith("full log archived"))).all()
    assert len(archived) == final.attempts
    # Each failed attempt's history entry names its archived log, and the store holds exactly that file.
    with services.sessions() as session:
        history = failures.of_buckets(session, [final.id])[final.id]
    logged = [f for f in history if f.phase == "compile"]
    assert len(logged) == final.attempts and all(f.log is not None for f in logged)
    assert sorted(f"full log archived as blob sha256:{f.log.sha256} ({f.log.size} bytes)"  # type: ignore[union-attr]
                  for f in logged) == sorted(archived)
    for failure in logged:
        assert failure.log is not None
        with services.store.open_blob(failure.log.sha256) as stream:
            assert len(stream.read()) == failure.log.size
    # Final classes answer a new submit from the negative cache; retried ones compile again.
    again = submit(services, args=args)
    assert (again.buckets[0].state == "failed") == (error_class in ("compile", "bad_request"))


# The trace path (torchscript models through torch_neuronx.trace): what trace raises is evidence too.
TRACE_ROW_CASES = [
    # No code at all: torch-xla refuses the operator while tracing, before neuronx-cc runs.
    pytest.param("unsupported-op", "compile", "UNSUPPORTED_OPERATOR", "aten::", id="unsupported-operator/trace"),
    pytest.param("disk-full", "infra", "DISK_FULL", "[Errno 28] No space left on device", id="disk-full/trace"),
    pytest.param("host-oom", "infra", "HOST_OOM", "can't allocate memory", id="host-out-of-memory/trace"),
    # hlo_compile's RuntimeError("neuronx-cc is not installed") is evidence only through its cause.
    pytest.param("missing-module", "infra", "MISSING_MODULE", "No module named 'neuronxcc'",
                 id="missing-module/trace"),
    pytest.param("host-os-error", "infra", "HOST_OS_ERROR", "[Errno 13] Permission denied",
                 id="host-os-error/trace"),
]


@pytest.fixture
def torchscript_uri(services: Services, tmp_path: Path) -> str:
    import torch

    class Masked(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return (input_ids * attention_mask).sum(-1)

    path = tmp_path / "masked.pt"
    example = (torch.zeros(1, 16, dtype=torch.int64), torch.ones(1, 16, dtype=torch.int64))
    torch.jit.save(torch.jit.trace(Masked(), example), str(path))
    return f"blob:sha256:{services.store.put_file(path).sha256}"


@pytest.mark.parametrize(("behaviour", "error_class", "code", "part"), TRACE_ROW_CASES)
def test_each_trace_failure_through_the_runner(services: Services, torchscript_uri: str, behaviour: str,
                                               error_class: str, code: str, part: str) -> None:
    """One attempt through the runner and the real child's torch_neuronx.trace (the double): a final class
    is final at once and answers a new submit from the negative cache; the host's trouble is requeued.
    (How often each class is retried is the CLI cases' business: one child run here keeps torch's import
    cost to one per case.)"""
    services.settings.retry_backoff_seconds = 0
    args = [f"--double-behaviour={behaviour}"]
    result = submit(services, uri=torchscript_uri, args=args, model_format="torchscript")
    outcome = run_compile(services, bucket(services, result).id, WORKER)
    final = error_class in ("compile", "bad_request")
    assert (outcome.status, outcome.error_class, outcome.code) == (
        "failed" if final else "queued", error_class, code), outcome
    assert part in (outcome.message or "")
    row = bucket(services, result)
    assert (row.attempts, row.state) == (1, "failed" if final else "queued")
    again = submit(services, uri=torchscript_uri, args=args, model_format="torchscript")
    assert (again.buckets[0].state == "failed") == final


def test_a_code_the_release_notes_call_non_deterministic_gets_one_retry(services: Services,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2.30.0 and 2.31.0 compiler notes fixed "non-deterministic compilation failures caused by data races
    in control flow validation" (NCC_CFG…, 2.29.0 notes). On 2.27.1 the compiler fails with NCC_CFG015 once and
    not the next time (the double told so between the attempts): the compile is retried once, and succeeds."""
    services.settings.retry_backoff_seconds = 0
    monkeypatch.setenv(BEHAVIOUR_ENV, "ncc-error:NCC_CFG015")
    result = submit(services, args=[])
    row = bucket(services, result)
    first = run_compile(services, row.id, WORKER)
    assert (first.status, first.error_class, first.code) == ("queued", "compile", "NCC_CFG015")
    monkeypatch.delenv(BEHAVIOUR_ENV)  # the race goes the other way this time
    second = run_compile(services, row.id, WORKER)
    assert second.status == "succeeded", second
    final = bucket(services, result)
    assert (final.state, final.attempts) == ("succeeded", 2)
    with services.sessions() as session:
        history = failures.of_buckets(session, [final.id])[final.id]
    assert [(f.error_class, f.code, f.retry) for f in history] == [("compile", "NCC_CFG015", True)]


def test_on_a_release_with_the_fix_the_same_code_is_final_at_once(services: Services,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """2.31.0 ships the fix: NCC_CFG015 there is a compile error like any other, negatively cached at once."""
    services.settings.retry_backoff_seconds = 0
    double = neuron_double_env(sdk="2.31.0")
    for name in ("PYTHONPATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE"):
        monkeypatch.setenv(name, double[name])
    result = submit(services, args=["--double-behaviour=ncc-error:NCC_CFG015"], sdk="2.31.0")
    row = bucket(services, result)
    outcome = run_compile(services, row.id, WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("failed", "compile", "NCC_CFG015"), outcome
    assert bucket(services, result).attempts == 1
    again = submit(services, args=["--double-behaviour=ncc-error:NCC_CFG015"], sdk="2.31.0")
    assert again.buckets[0].state == "failed"  # the negative cache


def test_every_row_of_the_table_has_a_worker_path_test() -> None:
    """Issue 7's "every row of the classification table has a test through the real worker path": each
    row of TABLE names a case above, and each case names a row."""
    ids = [case.id for case in [*ROW_CASES, *TRACE_ROW_CASES]]
    assert len(set(ids)) == len(ids)
    for row, test in ROWS_TESTED_ELSEWHERE.items():  # those tests exist, under the names given
        path, _, name = test.partition("::")
        assert f"def {name}(" in (Path(__file__).resolve().parents[3] / path).read_text(), (row, test)
    assert {str(case_id).split("/")[0] for case_id in ids} | set(ROWS_TESTED_ELSEWHERE) == {row.name for row in TABLE}


#: Rows whose worker-path test needs more than one attempt through a real worker, and where it is.
ROWS_TESTED_ELSEWHERE = {
    "corrupt-compile-cache":
        "tests/workers/test_neuron_compile_cache.py::test_a_corrupt_cache_entry_is_retried_and_then_succeeds",
}


def test_tp_through_the_runner_publishes_the_model_and_each_ranks_weights(services: Services,
                                                                         tmp_path: Path) -> None:
    """SDK 2.27.1: ModelBuilder's layout reaches the manifest, and the worker's rank bound reaches the child."""
    import torch

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(100, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.emb(input_ids) * attention_mask.unsqueeze(-1)

    path = tmp_path / "embed.pt"
    example = (torch.zeros(1, 16, dtype=torch.int64), torch.ones(1, 16, dtype=torch.int64))
    torch.jit.save(torch.jit.trace(Embed(), example), str(path))
    services.settings.neuron_max_parallel_rank_compiles = 3
    uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    result = Submitter(services).submit(parse_spec({
        "model": {"uri": uri, "format": "torchscript"}, "target": "inf2", "sdk": "2.27.1",
        "compiler": {"backend": "trace", "tp_degree": 2, "args": ["--auto-cast=none"]},
        "buckets": [{"batch_size": 1, "seq_len": 16}],
    }))
    row = bucket(services, result)
    outcome = run_compile(services, row.id, WORKER)
    assert outcome.status == "succeeded", outcome
    manifest = parse_bucket_manifest(services.store.read_document(bucket_manifest_name(row.key)), row.key)
    assert [(f.path, f.role) for f in manifest.files] == [
        ("model.pt", "model"), ("weights/tp0_sharded_checkpoint.safetensors", "weights-shard"),
        ("weights/tp1_sharded_checkpoint.safetensors", "weights-shard")]
    assert manifest.versions["neuronx_distributed"] == RELEASES["2.27.1"].neuronx_distributed
    with services.sessions() as session:
        lines = session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == row.id)).all()
    assert any("max_parallel_rank_compiles=3" in line for line in lines)


def test_a_changed_model_fails_until_a_new_submit_pins_the_same_bytes_again(services: Services,
                                                                           tmp_path: Path) -> None:
    model = tmp_path / "model.hlo.pb"
    model.write_bytes(b"pinned bytes")
    first = submit(services, uri=model.as_uri())
    model.write_bytes(b"other bytes!")  # changed after it was pinned
    outcome = run_compile(services, bucket(services, first).id, WORKER)
    # Not retried (the same pin fails the same way), and not a compile error: nothing about the key failed.
    assert (outcome.status, outcome.error_class, outcome.code) == ("failed", "model", "MODEL_UNAVAILABLE")
    with services.sessions() as session:
        assert session.scalars(select(Artifact.state)).one() == "failed"

    # The same bytes from another place: same key, so the failed compile is compiled anew with the new pin.
    again = tmp_path / "again" / "model.hlo.pb"
    again.parent.mkdir()
    again.write_bytes(b"pinned bytes")
    second = submit(services, uri=again.as_uri())
    assert (second.artifact_key, second.outcome, second.buckets[0].state) == (first.artifact_key, "new", "queued")
    row = bucket(services, second)
    assert row.model["uri"] == again.as_uri()
    assert run_compile(services, row.id, WORKER).status == "succeeded"
    with services.sessions() as session:
        assert session.scalars(select(Artifact.state)).one() == "published"


def test_a_missing_model_blob_is_an_infra_error(services: Services, tmp_path: Path) -> None:
    result = submit(services)
    row = bucket(services, result)
    (tmp_path / "store" / blob_name(row.model["sha256"])).unlink()
    outcome = run_compile(services, row.id, WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("queued", "infra", "MODEL_FETCH_FAILED")


def test_an_earlier_attempts_manifest_is_reused(services: Services) -> None:
    """An attempt that published its manifest and died before recording it: the next one reuses it."""
    result = submit(services)
    row = bucket(services, result)
    path = services.settings.data_dir / "earlier.neff"
    path.write_bytes(b"the earlier attempt's output")
    blob = services.store.put_file(path)
    earlier = BucketManifest(key=row.key, material=row.material, inputs=row.inputs,
                             files=[FileEntry(path="model.neff", role="model", size=blob.size, sha256=blob.sha256)],
                             versions={"neuronx_cc": "earlier"}, worker="earlier@host", compile_seconds=9.0,
                             created_at=utcnow().isoformat())
    assert services.store.create_document(bucket_manifest_name(row.key), earlier.to_bytes())
    outcome = run_compile(services, row.id, WORKER)
    assert outcome.status == "succeeded"
    assert services.store.read_document(bucket_manifest_name(row.key)) == earlier.to_bytes()
    done = bucket(services, result)
    assert (done.versions, done.compile_seconds) == ({"neuronx_cc": "earlier"}, 9.0)


def test_logstream_batches_in_order(services: Services, tmp_path: Path) -> None:
    result = submit(services)
    row = bucket(services, result)
    logs = LogStream(services.sessions, row.id, 1, tmp_path / "a.log", flush_interval=0.3, batch_lines=200)

    def central() -> list[tuple[str, str]]:
        with services.sessions() as session:
            return [(s, line) for s, line in session.execute(
                select(LogLine.stream, LogLine.line).where(LogLine.bucket_compile_id == row.id)
                .order_by(LogLine.id))]

    logs.service("starting")
    for n in range(450):
        logs.compiler(f"line {n}")
    logs.service("between")
    logs.compiler("last")
    deadline = time.monotonic() + 5
    while len(central()) < 453 and time.monotonic() < deadline:  # flushed without being closed
        time.sleep(0.05)
    expected = [("service", "starting"), *[("compiler", f"line {n}") for n in range(450)],
                ("service", "between"), ("compiler", "last")]
    assert central() == expected
    logs.close()
    text = (tmp_path / "a.log").read_text().splitlines()
    assert text[0] == "[compilesvc] starting" and text[1:451] == [f"line {n}" for n in range(450)]
    assert list(logs.tail)[-1] == "last" and len(logs.tail) == 200


def test_logstream_keeps_lines_while_the_database_is_away(services: Services, tmp_path: Path,
                                                          pg_url: str) -> None:
    result = submit(services)
    row = bucket(services, result)
    dead = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    sessions = make_sessionmaker(dead)
    logs = LogStream(sessions, row.id, 1, tmp_path / "b.log", flush_interval=0.1)
    for n in range(5):
        logs.compiler(f"line {n}")
    assert logs.flush() is False
    sessions.configure(bind=services.engine)  # the database is back
    logs.close()
    with services.sessions() as session:
        lines: list[Any] = list(session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == row.id)
                                                .order_by(LogLine.id)))
    assert lines == [f"line {n}" for n in range(5)]
    dead.dispose()


def test_orphaned_attempt_directories_are_swept(tmp_path: Path) -> None:
    """Directories of an attempt whose worker died are removed; a live attempt's (locked) are kept."""
    root = tmp_path / "root"
    for name in ("dead", "live"):
        (root / f"job-1-{name}").mkdir(parents=True)
        (root / f"work-1-{name}").mkdir()
        (root / f"work-1-{name}" / "scratch").write_bytes(b"x" * 1024)
        (root / f"job-1-{name}" / OWNER_LOCK).touch()
    old_unpaired = root / "work-2-gone"
    old_unpaired.mkdir()
    os.utime(old_unpaired, (time.time() - 7200, time.time() - 7200))
    fresh_unpaired = root / "work-3-starting"
    fresh_unpaired.mkdir()
    ownerless = root / "job-4-half-removed"  # no owner lock: swept once it is old
    ownerless.mkdir()
    os.utime(ownerless, (time.time() - 7200, time.time() - 7200))
    with open(root / "job-1-live" / OWNER_LOCK) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = sweep_orphaned_attempts(root)
    assert sorted(removed) == ["job-1-dead", "job-4-half-removed", "work-2-gone"]
    assert sorted(p.name for p in root.iterdir()) == ["job-1-live", "work-1-live", "work-3-starting"]


def test_a_claim_that_cannot_reach_the_ledger_is_not_acknowledged(tmp_path: Path) -> None:
    """The ledger is down for longer than the claim's retries: run_compile raises ClaimNotRecorded (the
    task gives its message back to the broker) instead of returning as if there were nothing to claim."""
    from tests.fixtures.private_services import PrivatePostgres

    postgres = PrivatePostgres()
    try:
        url = postgres.init().url
        services = Services.from_settings(Settings(
            data_dir=tmp_path / "data", database_url=url, store_url=(tmp_path / "store").as_uri(),
            broker_url="filesystem://", secret_key="k", require_live_worker=False, ledger_retry_seconds=2))
        try:
            submitted = submit(services, "ok")
            row = bucket(services, submitted)
            postgres.stop("fast")
            started = time.monotonic()
            with pytest.raises(ClaimNotRecorded):
                run_compile(services, row.id, WORKER)
            assert 0.2 <= time.monotonic() - started < 30  # retried within its budget, then gave up
            postgres.start()
            after = bucket(services, submitted)
            # Nothing was consumed: the compile is queued with no attempt spent, for the message given back.
            assert (after.state, after.attempts, after.worker_id) == ("queued", 0, None)
        finally:
            services.close()
    finally:
        postgres.close()


def test_a_compile_that_prints_past_the_output_limit_is_stopped_and_its_log_bounded(services: Services,
                                                                                     tmp_path: Path) -> None:
    """TorchScript's print() runs while the cpu backend executes the model: a model printing without end
    cannot fill the worker's disk or the ledger (COMPILESVC_SANDBOX_MAX_LOG_MB)."""
    import torch

    class Loud(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            for _ in range(1_000_000):
                print("compile output that goes on and on and on and on and on and on and on and on and on and on")
            return input_ids * attention_mask

    path = tmp_path / "loud.pt"
    torch.jit.save(torch.jit.script(Loud()), str(path))
    services.settings.sandbox_max_log_mb = 1
    uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    result = Submitter(services).submit(parse_spec({
        "model": {"uri": uri, "format": "torchscript"}, "target": "cpu", "sdk": "2.13.0",
        "compiler": {"backend": "torchscript"}, "buckets": [{"batch_size": 1, "seq_len": 16}],
    }))
    row = bucket(services, result)
    outcome = run_compile(services, row.id, WORKER)
    assert (outcome.status, outcome.error_class, outcome.code) == ("failed", "compile", "SANDBOX_OUTPUT_LIMIT")
    with services.sessions() as session:
        kept = session.scalar(select(func.sum(func.length(LogLine.line))).where(
            LogLine.bucket_compile_id == row.id, LogLine.stream == "compiler"))
        notes = list(session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == row.id,
                                                                LogLine.stream == "service")))
    assert kept is not None and kept <= 1024 * 1024
    assert any("the rest of its output is not kept" in line for line in notes)


def test_with_the_sandbox_off_a_compile_runs_as_the_worker_and_leaves_nothing(
        services: Services, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """COMPILESVC_SANDBOX=off (an operator isolating compiles another way): the compile runs unsandboxed,
    as the worker's user, and the attempt's directories (its private TMPDIR among them) are removed."""
    import torch

    class Where(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return input_ids * attention_mask

    path = tmp_path / "where.pt"
    torch.jit.save(torch.jit.script(Where()), str(path))
    services.settings.sandbox = "off"
    uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    result = Submitter(services).submit(parse_spec({
        "model": {"uri": uri, "format": "torchscript"}, "target": "cpu", "sdk": "2.13.0",
        "compiler": {"backend": "torchscript"}, "buckets": [{"batch_size": 1, "seq_len": 16}],
    }))
    row = bucket(services, result)
    caplog.set_level(logging.INFO, logger="workers.compiling.runner")
    assert run_compile(services, row.id, WORKER).status == "succeeded"
    started = [r for r in caplog.records if r.getMessage() == "compiler started"]
    assert [r.sandboxed for r in started] == [False]  # type: ignore[attr-defined]
    assert list(work_root().iterdir()) == []  # the attempt's directories, its TMPDIR among them, are gone
