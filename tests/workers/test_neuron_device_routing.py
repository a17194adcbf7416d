"""A trace compile of a release without ``cpu_backend`` (before SDK 2.21.0) reaches only a worker with a
Neuron device (issue 28, deliverable 3), end to end: real workers, the relay, the ledger on the session's
Postgres, the shared Redis, and the Neuron TEST DOUBLE, which on 2.19 cannot trace without a device
(aws-neuron-sdk#910; the keyword first appears in the 2.21.0 trace API reference, commit 752349fd).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from compilesvc.dispatch.registry import live_workers
from compilesvc.dispatch.routing import queue_name
from compilesvc.refusals import NoCapableWorker
from tests.doubles import neuron_double_env, with_devices
from tests.workers.conftest import Cluster

MakeCluster = Callable[..., Cluster]
RELEASE = "2.19.0"


def _worker_env(cluster: Cluster, root: Path, devices: int) -> dict[str, str]:
    """A 2.19.0 host with ``devices`` Neuron devices (none: device nodes nowhere, the double's count 0)."""
    env = neuron_double_env(cluster.env, sdk=RELEASE, devices=0)
    root.mkdir(parents=True, exist_ok=True)
    env["COMPILESVC_NEURON_DEVICE_GLOB"] = str(root / "none" / "neuron[0-9]*")
    return with_devices(env, root, devices) if devices else env


def test_a_2_19_trace_spec_routes_only_to_a_worker_with_a_device(make_cluster: MakeCluster, tiny_torch_model: Path,
                                                                  tmp_path: Path) -> None:
    cluster = make_cluster()
    uri = cluster.upload(tiny_torch_model.read_bytes(), "tiny.pt2")
    spec = {"model": {"uri": uri, "format": "exported-program", "name": "tiny"}, "target": "inf2", "sdk": RELEASE,
            "buckets": [{"batch_size": 1, "seq_len": 8}]}
    queue = queue_name("inf2", RELEASE, "trace")

    cluster.start_worker("bare", concurrency=1, env=_worker_env(cluster, tmp_path / "bare", 0))
    with cluster.services.sessions() as session:
        [bare] = live_workers(session, cluster.settings.worker_stale_seconds)
    assert bare.capabilities["neuron"]["devices"] == 0 and queue not in bare.queues
    assert queue_name("inf2", RELEASE, "neuronx-cc") in bare.queues  # it serves this release's HLO compiles
    with pytest.raises(NoCapableWorker, match=r"need a host with a Neuron device") as refused:
        cluster.submit(spec)
    assert queue in str(refused.value) and "2.21.0" in str(refused.value)

    cluster.start_worker("dev", concurrency=1, env=_worker_env(cluster, tmp_path / "dev", 1))
    cluster.start_relay()
    result = cluster.submit(spec)
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=150)
    bucket = cluster.bucket(result.buckets[0].key)
    assert artifact.state == "published", bucket.error_message
    assert (bucket.queue, bucket.worker_id, bucket.attempts) == (queue, "dev@test", 1)
    assert bucket.versions["trace_lowering"] == "device"
