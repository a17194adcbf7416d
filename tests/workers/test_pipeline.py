"""The compile pipeline with real processes: submit -> outbox -> Redis -> ``compilesvc worker`` -> compile
child -> artifact store -> ledger, with ``compilesvc relay`` as the reaper where a test needs one.

Nothing of ours is mocked. The cpu target runs the real torchscript backend; slow, failing and crashing
compiles come from the Neuron TEST DOUBLE (``tests/doubles/neuron``), chosen per spec with the
``--double-behaviour=...`` compiler flag.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from compilesvc.builds.control import cancel_build, retry_build
from compilesvc.compiles import failures
from compilesvc.config.settings import Settings
from compilesvc.dispatch.outbox import OutboxRelay
from compilesvc.dispatch.registry import live_workers
from compilesvc.dispatch.routing import COMPILE_TASK, make_producer
from compilesvc.ledger.models import Artifact, Build, Event, LogLine, Outbox
from compilesvc.lifecycle.artifacts import read_manifest
from compilesvc.refusals import NoCapableWorker
from compilesvc.store import ArtifactStore
from tests.doubles import neuron_double_env
from tests.doubles.neuron._release import RACE_ENV, RELEASES, coded
from tests.fixtures.s3server import S3Server
from tests.workers.conftest import (
    HLO_MODEL,
    NEURON_SDK,
    REDIS_URL,
    Cluster,
    ServiceProcess,
    redis_connections_of,
    wait_for,
)

MakeCluster = Callable[..., Cluster]


# -- helpers -------------------------------------------------------------------------------------------

def processes_of(job_dir: str) -> list[int]:
    """Live (non-zombie) processes of one compile attempt: those whose command line names its job directory
    (bubblewrap, the compile child inside it, the compiler it runs). Process groups do not tell: the sandbox
    starts the child in a session of its own."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z" and job_dir in cmdline:
            found.append(int(entry.name))
    return found


def compiler_pids(worker: ServiceProcess, bucket_id: int) -> list[int]:
    return [int(r["pid"]) for r in worker.logged("compiler started", bucket_compile_id=bucket_id)]


def compiler_jobs(worker: ServiceProcess, bucket_id: int) -> list[str]:
    return [str(r["job_dir"]) for r in worker.logged("compiler started", bucket_compile_id=bucket_id)]


def blob_sha256(store: ArtifactStore, sha256: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    for chunk in store.iter_blob(sha256):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def assert_manifest_matches_blobs(cluster: Cluster, artifact_key: str, buckets: int) -> None:
    manifest = read_manifest(cluster.services.store, artifact_key)
    assert manifest is not None and len(manifest.buckets) == buckets
    for entry in manifest.buckets:
        assert entry.files and entry.log is not None
        for file in [*entry.files, entry.log]:
            assert blob_sha256(cluster.services.store, file.sha256) == (file.sha256, file.size)
    assert manifest.size_bytes == sum(f.size for e in manifest.buckets for f in e.files)


def count(cluster: Cluster, model: type, *where: Any) -> int:
    with cluster.services.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def overlapping(intervals: list[tuple[Any, Any]]) -> bool:
    return any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(intervals) for (b0, b1) in intervals[i + 1:])


# -- tests ---------------------------------------------------------------------------------------------

def test_three_buckets_compile_in_parallel_into_one_artifact(make_cluster: MakeCluster,
                                                            tiny_torch_model: Path) -> None:
    """(a) 3 buckets on 2 worker slots: two run at once, one artifact is published, and every file the
    manifest names is in the store with that sha256. Registration is what lets the submit in."""
    cluster = make_cluster()
    uri = cluster.upload(tiny_torch_model.read_bytes(), "tiny.pt2")
    spec = {"model": {"uri": uri, "format": "exported-program", "name": "tiny"}, "target": "cpu", "sdk": "2.13.0",
            "buckets": [{"batch_size": 1, "seq_len": 8}, {"batch_size": 1, "seq_len": 16},
                        {"batch_size": 2, "seq_len": 16}]}
    with pytest.raises(NoCapableWorker):
        cluster.submit(spec)  # nobody serves compile.cpu.2.13.0 yet

    worker = cluster.start_worker("w1", concurrency=2)
    result = cluster.submit(spec)
    assert (result.outcome, len(result.buckets)) == ("new", 3)
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=150)
    assert artifact.state == "published", [cluster.bucket(b.key).error_message for b in result.buckets]

    buckets = [cluster.bucket(b.key) for b in result.buckets]
    assert all(b.state == "succeeded" and b.attempts == 1 and b.worker_id == "w1@test" for b in buckets)
    assert overlapping([(b.started_at, b.finished_at) for b in buckets]), "two slots should compile at once"
    assert count(cluster, Artifact) == 1 and artifact.manifest_uri
    assert_manifest_matches_blobs(cluster, result.artifact_key, 3)
    with cluster.services.sessions() as session:
        assert session.get_one(Build, result.build_id).state == "succeeded"
        for bucket in buckets:  # the compiler's output reached the central log, tagged by attempt
            streams = set(session.scalars(select(LogLine.stream).where(LogLine.bucket_compile_id == bucket.id,
                                                                       LogLine.attempt == 1)))
            assert streams == {"compiler", "service"}
    # Every line the worker process printed is one JSON object in the shared format (compilesvc.jsonlog):
    # no Celery banner, no multi-line warning text.
    printed = worker.log_path.read_text().splitlines()
    assert printed and all(json.loads(line)["service"] == "worker" for line in printed), printed[:5]


def test_killed_worker_is_recovered_by_the_reaper(make_cluster: MakeCluster) -> None:
    """(b) A worker SIGKILLed mid-compile: its lease runs out, the reaper requeues the compile (fencing
    the dead worker's token), another worker finishes it: one artifact, one manifest, no orphan compiler."""
    cluster = make_cluster()
    relay = cluster.start_relay(wait=False)
    doomed = cluster.start_worker("doomed", concurrency=1)
    relay.wait_ready()
    result = cluster.submit(cluster.hlo_spec("slow:3"))
    key = result.buckets[0].key
    bucket = cluster.wait_bucket(key, ("running",))
    assert bucket.worker_id == "doomed@test"
    job = wait_for(lambda: compiler_jobs(doomed, bucket.id), 20, "the compiler to start")[0]
    rescuer = cluster.start_worker("rescuer", concurrency=1, wait=False)  # boots while the lease runs out

    doomed.kill_group(signal.SIGKILL)
    doomed.proc.wait(10)
    wait_for(lambda: not processes_of(job), 10, "the orphaned compiler to die with its worker")

    done = cluster.wait_bucket(key, ("succeeded", "failed"), timeout=40)
    assert (done.state, done.worker_id, done.attempts) == ("succeeded", "rescuer@test", 2)
    assert cluster.wait_artifact(result.artifact_key, ("published",), 10).state == "published"
    assert cluster.transitions(bucket.id) == [(None, "queued"), ("queued", "running"), ("running", "queued"),
                                              ("queued", "running"), ("running", "succeeded")]
    with cluster.services.sessions() as session:
        requeue = session.scalars(select(Event).where(Event.entity == "bucket", Event.entity_id == bucket.id,
                                                      Event.to_state == "queued", Event.from_state == "running"))
        assert requeue.one().detail["reason"] == "lease expired"
    assert relay.logged("lease expired", bucket_compile_id=bucket.id)
    assert count(cluster, Artifact) == 1
    assert len(list((cluster.tmp / "store" / "artifacts").glob("*/manifest.json"))) == 1
    assert_manifest_matches_blobs(cluster, result.artifact_key, 1)
    assert rescuer.logged("compile succeeded", bucket_compile_id=bucket.id, attempt=2)


@pytest.mark.slow
def test_stale_worker_late_result_is_rejected(make_cluster: MakeCluster) -> None:
    """A worker frozen (SIGSTOP) past its lease wakes up after another worker finished the compile: its
    heartbeat and its late writes find a newer token, so it records nothing and kills nothing of theirs."""
    cluster = make_cluster()
    relay = cluster.start_relay(wait=False)
    frozen = cluster.start_worker("frozen", concurrency=1)
    relay.wait_ready()
    result = cluster.submit(cluster.hlo_spec("slow:5"))
    key = result.buckets[0].key
    bucket = cluster.wait_bucket(key, ("running",))
    wait_for(lambda: compiler_pids(frozen, bucket.id), 20, "the compiler to start")
    frozen.kill_group(signal.SIGSTOP)  # its compiler (own session) runs on; its lease heartbeat does not
    try:
        other = cluster.start_worker("other", concurrency=1)
        done = cluster.wait_bucket(key, ("succeeded",), timeout=40)
        assert (done.worker_id, done.attempts) == ("other@test", 2)
    finally:
        frozen.kill_group(signal.SIGCONT)
    wait_for(lambda: frozen.logged("lease lost", bucket_compile_id=bucket.id)
             or frozen.logged("lease lost before the success was recorded; another attempt owns the compile"),
             20, "the frozen worker to notice it lost the lease")
    wait_for(lambda: frozen.logged("task done", bucket_compile_id=bucket.id, result="lease-lost"), 20,
             "the frozen worker to finish its task")
    after = cluster.bucket(key)
    assert (after.state, after.worker_id, after.attempts, after.manifest_uri) == (
        "succeeded", "other@test", 2, done.manifest_uri)
    assert [t for t in cluster.transitions(bucket.id) if t[1] == "succeeded"] == [("running", "succeeded")]
    assert other.logged("compile succeeded", bucket_compile_id=bucket.id)
    assert not frozen.logged("compile succeeded", bucket_compile_id=bucket.id)
    # The other worker publishes the set after committing its bucket, which the waits above do not cover.
    assert cluster.wait_artifact(result.artifact_key, ("published",), 20).state == "published"
    assert count(cluster, Artifact, Artifact.state == "published") == 1


def test_duplicate_delivery_runs_nothing(make_cluster: MakeCluster) -> None:
    """(c) The same task sent again (while running, and after success) finds nothing to claim."""
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=2)
    result = cluster.submit(cluster.hlo_spec("slow:2"))
    key = result.buckets[0].key
    bucket = cluster.wait_bucket(key, ("running",))
    with cluster.services.sessions() as session:
        kwargs = session.scalars(select(Outbox.kwargs).where(Outbox.bucket_compile_id == bucket.id)).one()
    producer = cluster.services.producer
    producer.send_task(COMPILE_TASK, kwargs=kwargs, task_id="duplicate-while-running")
    wait_for(lambda: worker.logged("duplicate delivery: nothing to claim", bucket_compile_id=bucket.id), 20,
             "the duplicate to be refused while the compile runs")
    cluster.wait_bucket(key, ("succeeded",), timeout=30)
    producer.send_task(COMPILE_TASK, kwargs=kwargs, task_id="duplicate-after-success")
    wait_for(lambda: len(worker.logged("duplicate delivery: nothing to claim", bucket_compile_id=bucket.id)) == 2,
             20, "the duplicate to be refused after success")
    done = cluster.bucket(key)
    assert (done.state, done.attempts) == ("succeeded", 1)
    assert cluster.transitions(bucket.id).count(("queued", "running")) == 1
    assert len(compiler_pids(worker, bucket.id)) == 1


def test_a_broker_disconnect_does_not_stop_a_running_compile(make_cluster: MakeCluster) -> None:
    """Redis drops the worker's connections mid-compile: the compile runs on and finishes once (busy with it,
    the worker reads nothing from Redis, so it acknowledges over a new connection; were the message
    redelivered, the claim would make that a no-op), and the reconnected worker takes new work."""
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=1)
    first = cluster.submit(cluster.hlo_spec("slow:3"))
    bucket = cluster.wait_bucket(first.buckets[0].key, ("running",))
    wait_for(lambda: compiler_pids(worker, bucket.id), 20, "the compiler to start")
    client = redis.Redis.from_url(REDIS_URL)
    addresses = redis_connections_of(worker.proc.pid)
    assert addresses
    for address in addresses:
        client.client_kill(address)
    client.close()
    done = cluster.wait_bucket(first.buckets[0].key, ("succeeded", "failed", "queued"), timeout=30)
    assert (done.state, done.attempts) == ("succeeded", 1)
    second = cluster.submit(cluster.hlo_spec("ok"))
    assert cluster.wait_artifact(second.artifact_key, ("published", "failed"), 30).state == "published"
    assert len(compiler_pids(worker, bucket.id)) == 1


def test_cancel_stops_the_compiler_process_group(make_cluster: MakeCluster) -> None:
    """(d) Cancelling a build during a slow compile kills the compiler's whole process group within a few
    seconds and leaves the compile cancelled."""
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:60"))
    key = result.buckets[0].key
    bucket = cluster.wait_bucket(key, ("running",))
    job = wait_for(lambda: compiler_jobs(worker, bucket.id), 20, "the compiler to start")[0]
    wait_for(lambda: count(cluster, LogLine, LogLine.bucket_compile_id == bucket.id,
                           LogLine.line.contains("progress: pass")) >= 2, 20, "the compiler's progress lines")
    assert len(processes_of(job)) >= 3  # bubblewrap, the child and the neuronx-cc (double) it runs

    started = time.monotonic()
    cancel_build(cluster.services, result.build_id)
    cancelled = cluster.wait_bucket(key, ("cancelled", "failed", "succeeded"), timeout=15)
    elapsed = time.monotonic() - started
    assert cancelled.state == "cancelled" and cancelled.error_class == "cancelled"
    assert elapsed < 8, f"cancel took {elapsed:.1f}s"
    assert processes_of(job) == []
    assert cluster.artifact(result.artifact_key).state == "cancelled"
    with cluster.services.sessions() as session:
        assert session.get_one(Build, result.build_id).state == "cancelled"
    assert worker.logged("cancel requested: stopping the compiler", bucket_compile_id=bucket.id)


def test_timeout_is_retried_up_to_max_attempts(make_cluster: MakeCluster) -> None:
    """(e) A compile over the time limit is classified 'timeout', retried, and fails after max_attempts."""
    # With a backoff the requeue waits in the outbox for the relay; without one the worker sends it itself.
    cluster = make_cluster(compile_timeout_seconds=1, max_attempts=2, retry_backoff_seconds=0)
    worker = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:30"))
    key = result.buckets[0].key
    failed = cluster.wait_bucket(key, ("failed", "succeeded"), timeout=40)
    assert (failed.state, failed.error_class, failed.error_code, failed.attempts) == ("failed", "timeout",
                                                                                      "TIMEOUT", 2)
    assert cluster.transitions(failed.id) == [(None, "queued"), ("queued", "running"), ("running", "queued"),
                                              ("queued", "running"), ("running", "failed")]
    assert cluster.artifact(result.artifact_key).state == "failed"
    assert [r["attempt"] for r in worker.logged("compile attempt failed", bucket_compile_id=failed.id)] == [1, 2]
    for job in compiler_jobs(worker, failed.id):
        assert processes_of(job) == []


def test_a_non_deterministic_compile_failure_is_retried_once_by_a_worker(make_cluster: MakeCluster,
                                                                          tmp_path: Path) -> None:
    """The 2.30.0/2.31.0 compiler notes fixed "non-deterministic compilation failures caused by data races in
    control flow validation" (NCC_CFG…, 2.29.0 notes). A worker of 2.27.1 whose compiler loses the race once
    (the double fails while a file exists; the test removes it after the first failure) retries the compile
    once, and it succeeds: the NCC_CFG015 failure was not made final."""
    race = tmp_path / "race"
    race.mkdir()
    lost = race / "lost"
    lost.write_text("NCC_CFG015")
    cluster = make_cluster(retry_backoff_seconds=3, sandbox_read_paths=str(race))
    double = neuron_double_env(cluster.env, sdk="2.27.1")
    cluster.start_worker("w1", concurrency=1, env={
        **{k: double[k] for k in ("PYTHONPATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE")},
        RACE_ENV: str(lost)})
    cluster.start_relay()  # sends the requeue once its backoff is over
    result = cluster.submit({**cluster.hlo_spec(), "sdk": "2.27.1", "compiler": {"args": []}})
    key = result.buckets[0].key

    def first_failure() -> list[Any]:
        with cluster.services.sessions() as session:
            return failures.of_buckets(session, [cluster.bucket(key).id]).get(cluster.bucket(key).id, [])

    history = wait_for(first_failure, 30, "the first attempt to fail")
    lost.unlink()  # the next attempt wins the race
    assert [(f.error_class, f.code, f.retry) for f in history] == [("compile", "NCC_CFG015", True)]
    done = cluster.wait_bucket(key, ("succeeded", "failed"), timeout=60)
    assert (done.state, done.attempts) == ("succeeded", 2), (done.state, done.error_code, done.error_message)
    assert cluster.wait_artifact(result.artifact_key, ("published", "failed"), 30).state == "published"


def test_compile_error_is_final_and_negatively_cached(make_cluster: MakeCluster) -> None:
    """(f) A compiler error fails the compile, its artifact and build for good; submitting the spec again
    joins the failure without compiling; an explicit retry compiles again."""
    # The compile child emulates the worker's release (the allow-listed COMPILESVC_NEURON_DOUBLE_RELEASE
    # reaches it), and SDK 2.20.0's compiler prints the code bare (tests/doubles/neuron/_release.py).
    code = coded("NCC_EOOM001", RELEASES[NEURON_SDK])
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=1)
    spec = cluster.hlo_spec("ncc-error")
    first = cluster.submit(spec)
    key = first.buckets[0].key
    failed = cluster.wait_bucket(key, ("failed", "succeeded"), timeout=30)
    assert (failed.state, failed.error_class, failed.error_code, failed.attempts) == ("failed", "compile", code, 1)
    assert cluster.wait_artifact(first.artifact_key, ("failed",), 5).state == "failed"
    with cluster.services.sessions() as session:
        assert session.get_one(Build, first.build_id).state == "failed"
        archived = session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == failed.id,
                                                              LogLine.line.startswith("full log archived"))).one()
    log_sha = archived.split("sha256:")[1].split()[0]
    log_text = b"".join(cluster.services.store.iter_blob(log_sha)).decode()
    assert f"[{code}]" in log_text

    outbox_rows = count(cluster, Outbox)
    second = cluster.submit(spec)
    assert (second.outcome, second.state, second.artifact_state) == ("join", "failed", "failed")
    assert count(cluster, Outbox) == outbox_rows  # nothing was queued
    # A compile submitted after the join and finished on the same worker's queue: had the join queued the
    # failed bucket again, that message would have come first.
    sentinel = cluster.submit(cluster.hlo_spec("ok"))
    assert cluster.wait_artifact(sentinel.artifact_key, ("published", "failed"), 30).state == "published"
    assert cluster.bucket(key).attempts == 1 and len(compiler_pids(worker, failed.id)) == 1

    retry_build(cluster.services, first.build_id)
    wait_for(lambda: len(worker.logged("compile attempt failed", bucket_compile_id=failed.id)) == 2, 30,
             "the retried compile to run (and fail the same way)")
    again = cluster.wait_bucket(key, ("failed",), timeout=10)
    assert (again.error_code, again.attempts) == (code, 1)  # the retry reset the attempts
    assert cluster.transitions(failed.id).count(("queued", "running")) == 2


def test_outbox_rows_written_during_a_broker_outage_are_relayed_later(make_cluster: MakeCluster) -> None:
    """(g) With the broker unreachable, submits still commit their outbox rows; the relay sends them once
    the broker is back, and the compiles run."""
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=2)
    down = make_producer(Settings(**{**cluster.settings.model_dump(), "broker_url": "redis://127.0.0.1:1/0"}))
    down.conf.broker_connection_timeout = 0.5
    cluster.services.producer = down  # type: ignore[misc]  # the API's view of the broker: down
    cluster.services.__dict__.pop("relay", None)

    result = cluster.submit(cluster.hlo_spec("ok", buckets=2))
    assert [b.state for b in result.buckets] == ["queued", "queued"]
    with cluster.services.sessions() as session:
        rows = session.scalars(select(Outbox).order_by(Outbox.id)).all()
    assert len(rows) == 2 and all(r.sent_at is None for r in rows)
    assert rows[0].last_error and "127.0.0.1:1" in rows[0].last_error  # the failed send is on record
    assert OutboxRelay(cluster.services.sessions, down).relay() == 0  # still down: nothing is lost
    assert count(cluster, Outbox, Outbox.sent_at.is_(None)) == 2  # nothing reached a broker to run
    assert [cluster.bucket(b.key).state for b in result.buckets] == ["queued", "queued"]

    relay = cluster.start_relay()  # the relay process talks to the real broker
    assert cluster.wait_artifact(result.artifact_key, ("published", "failed"), 40).state == "published"
    assert count(cluster, Outbox, Outbox.sent_at.is_(None)) == 0
    relay.stop()  # SIGTERM: finishes its pass and exits cleanly
    assert relay.proc.returncode == 0 and relay.logged("relay stopped")
    for bucket in result.buckets:
        assert worker.logged("compile succeeded", bucket_compile_id=cluster.bucket(bucket.key).id)
    down.close()


def test_pipeline_with_the_s3_store(make_cluster: MakeCluster, s3_server: S3Server,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pipeline on a real S3 server: blobs, manifests and the model all live in S3."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket_name = s3_server.new_bucket("compilesvc")
    cluster = make_cluster(store_url=f"s3://{bucket_name}/artifacts", s3_endpoint_url=s3_server.endpoint_url,
                           extra_env=s3_server.env())
    cluster.start_worker("w1", concurrency=2)
    result = cluster.submit(cluster.hlo_spec("ok", buckets=2))
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), 40)
    assert artifact.state == "published" and artifact.manifest_uri == (
        f"s3://{bucket_name}/artifacts/artifacts/{result.artifact_key}/manifest.json")
    assert_manifest_matches_blobs(cluster, result.artifact_key, 2)
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket_name)["Contents"]}
    assert f"artifacts/artifacts/{result.artifact_key}/manifest.json" in keys
    assert sum(k.startswith("artifacts/buckets/") for k in keys) == 2


def test_worker_registration_tracks_its_life(make_cluster: MakeCluster) -> None:
    """A worker registers its queues and slots on start and marks itself stopped on SIGTERM."""
    cluster = make_cluster()
    worker = cluster.start_worker("w1", concurrency=3)
    with cluster.services.sessions() as session:
        (row,) = live_workers(session, 10)
        assert (row.id, row.slots) == ("w1@test", 3)
        assert "compile.inf2.2.20.0.neuronx-cc" in row.queues and "compile.cpu.2.13.0" in row.queues
        assert row.capabilities["sdk"]["inf2"] == "2.20.0"
    worker.stop()
    assert worker.proc.returncode == 0
    with cluster.services.sessions() as session:
        assert live_workers(session, 10) == []
    with pytest.raises(NoCapableWorker):
        cluster.submit(cluster.hlo_spec())


def test_a_compile_joined_across_releases_of_one_toolchain_runs_on_either(make_cluster: MakeCluster) -> None:
    """2.27.0 and 2.27.1 ship identical packages, so their compiles share keys. A 2.27.1 build joining a
    compile first queued for 2.27.0 is served by a 2.27.1 worker (none of 2.27.0 exists): both builds end
    with the one artifact, and the worker says it ran a 2.27.0 request on its identical toolchain."""
    cluster = make_cluster()
    cluster.start_worker("w271", concurrency=1, env=neuron_double_env(cluster.env, sdk="2.27.1"))
    uri = cluster.upload(HLO_MODEL, "model.hlo.pb")
    first = cluster.submit(cluster.hlo_spec("slow:3", uri=uri, sdk="2.27.0"))
    second = cluster.submit(cluster.hlo_spec("slow:3", uri=uri, sdk="2.27.1"))
    assert first.outcome == "new" and second.outcome in ("join", "hit")
    assert second.artifact_key == first.artifact_key
    artifact = cluster.wait_artifact(first.artifact_key, ("published", "failed"), timeout=60)
    assert artifact.state == "published", cluster.bucket(first.buckets[0].key).error_message
    done = cluster.bucket(first.buckets[0].key)
    assert (done.worker_id, done.attempts, done.sdk) == ("w271@test", 1, "2.27.0")
    assert done.queue == "compile.inf2.2.27.0.neuronx-cc"
    with cluster.services.sessions() as session:
        assert {session.get_one(Build, r.build_id).state for r in (first, second)} == {"succeeded"}
        lines = session.scalars(select(LogLine.line).where(LogLine.bucket_compile_id == done.id)).all()
    assert any("runs on 2.27.1: the same toolchain" in line for line in lines), lines[-20:]
