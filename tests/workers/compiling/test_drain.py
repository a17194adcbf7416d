"""Draining (workers/compiling/drain.py, issue 30): a worker told to stop, as an autoscaler tells it (SIGTERM,
then SIGKILL a grace period later), with real worker processes on Postgres and Redis and the lease at its
production length (60 s), so that nothing here can be the lease running out."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
from sqlalchemy import func, select

from compilesvc.ledger.models import BucketFailure, Worker
from tests.workers.conftest import Cluster, wait_for

pytestmark = pytest.mark.slow
MakeCluster = Callable[..., Cluster]


def running_on(cluster: Cluster, key: str, worker: str) -> bool:
    bucket = cluster.bucket(key)
    return bucket.state == "running" and bucket.worker_id == worker


def failures_of(cluster: Cluster, bucket_id: int) -> int:
    with cluster.services.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(BucketFailure)
                                  .where(BucketFailure.bucket_compile_id == bucket_id)) or 0)


def worker_row(cluster: Cluster, worker_id: str) -> Worker:
    with cluster.services.sessions() as session:
        return session.get_one(Worker, worker_id)


def test_a_compile_longer_than_the_drain_window_is_handed_back_and_runs_elsewhere_at_once(
        make_cluster: MakeCluster) -> None:
    cluster = make_cluster(lease_seconds=60, heartbeat_seconds=2, drain_seconds=3)
    w1 = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:12"))
    key = result.buckets[0].key
    wait_for(lambda: running_on(cluster, key, "w1@test"), 30, "the compile to run on w1")
    wait_for(lambda: w1.logged("compiler started"), 20, "w1's compiler to start")
    cluster.start_worker("w2", concurrency=1)

    told = time.monotonic()
    w1.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: worker_row(cluster, "w1@test").draining_at is not None, 5, "w1 to say it is draining")
    wait_for(lambda: running_on(cluster, key, "w2@test"), 10, "the compile to run on w2")
    moved = time.monotonic() - told
    assert moved < 10, f"the compile ran elsewhere {moved:.1f}s after SIGTERM"
    assert w1.proc.wait(15) == 0  # well inside a grace period: nothing waited for the lease
    assert w1.logged("compile handed back")

    done = cluster.wait_artifact(result.artifact_key, ("published", "failed"), 60)
    assert done.state == "published"
    bucket = cluster.bucket(key)
    assert (bucket.state, bucket.worker_id, bucket.attempts, bucket.interruptions) == ("succeeded", "w2@test", 2, 1)
    assert failures_of(cluster, bucket.id) == 0  # the interruption is not a failure of the build
    assert ("running", "queued") in cluster.transitions(bucket.id)


def test_a_compile_that_fits_the_drain_window_finishes_on_the_draining_worker(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(lease_seconds=60, heartbeat_seconds=2, drain_seconds=30)
    w1 = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:4"))
    key = result.buckets[0].key
    wait_for(lambda: w1.logged("compiler started"), 30, "w1's compiler to start")
    w1.proc.send_signal(signal.SIGTERM)
    assert w1.proc.wait(30) == 0  # it exits once the compile is published, not at the window's end
    assert cluster.artifact(result.artifact_key).state == "published"
    bucket = cluster.bucket(key)
    assert (bucket.state, bucket.worker_id, bucket.attempts, bucket.interruptions) == ("succeeded", "w1@test", 1, 0)
    row = worker_row(cluster, "w1@test")
    assert row.draining_at is not None and row.stopped_at is not None


def test_a_worker_with_max_compiles_stops_after_them(make_cluster: MakeCluster) -> None:
    """``--max-compiles 1``: a Kubernetes Job's worker compiles once and exits 0 (the chart's ScaledJob mode);
    the next compile waits for the next Job."""
    cluster = make_cluster(lease_seconds=60, heartbeat_seconds=2)
    worker = cluster._start("w1", ["worker", "-c", "1", "-n", "w1@test", "--max-compiles", "1"], None)
    worker.wait_ready()
    first = cluster.submit(cluster.hlo_spec("slow:1"))
    second = cluster.submit(cluster.hlo_spec("slow:2"))
    assert worker.proc.wait(60) == 0
    states = sorted(cluster.bucket(r.buckets[0].key).state for r in (first, second))
    assert states == ["queued", "succeeded"]
    assert worker.logged("max compiles reached: stopping")
    assert worker_row(cluster, "w1@test").stopped_at is not None
