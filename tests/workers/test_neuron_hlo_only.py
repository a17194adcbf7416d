"""A host with neuronx-cc and no torch-neuronx serves HLO compiles end to end (issue 28, deliverable 1).

SDK 2.32.0's manifest (aws-neuron/aws-neuron-sdk src/helperscripts/n2-manifest.json, manifest_version
2.32.0) lists neuronx-cc 2.27.5334.0 and no torch-neuronx or neuronx_distributed; the Neuron TEST DOUBLE
installs just that for it (tests/doubles/neuron/_release.py). Real processes: a worker, the relay, the
ledger on the session's Postgres, the shared Redis.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from compilesvc.dispatch.registry import live_workers
from compilesvc.refusals import NoCapableWorker
from compilesvc.spec.parsing import SpecError
from tests.doubles import neuron_double_env
from tests.workers.conftest import Cluster

MakeCluster = Callable[..., Cluster]
RELEASE = "2.32.0"


def release_host_env() -> dict[str, str]:
    """What differs on a 2.32.0 host: the claimed release and the double's packages (neuronxcc alone)."""
    env = neuron_double_env({"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": os.environ["PATH"]},
                            sdk=RELEASE)
    return {k: env[k] for k in ("PYTHONPATH", "PATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE")}


def test_a_2_32_0_hlo_spec_compiles_on_a_worker_without_torch_neuronx(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    spec = cluster.hlo_spec(sdk=RELEASE)  # overrides the fixture's release
    with pytest.raises(NoCapableWorker, match=r"compile\.inf2\.2\.32\.0\.neuronx-cc"):
        cluster.submit(spec)  # refused as ever while no live worker serves the queue, naming it

    cluster.start_worker("w232", concurrency=1, env=release_host_env())
    cluster.start_relay()
    with cluster.services.sessions() as session:
        [worker] = live_workers(session, cluster.settings.worker_stale_seconds)
    caps = worker.capabilities
    assert caps["versions"]["torch_neuronx"] is None and caps["neuron"]["release"] == RELEASE
    assert not [queue for queue in worker.queues if ".trace" in queue]

    result = cluster.submit(spec)
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=120)
    assert artifact.state == "published", [cluster.bucket(b.key).error_message for b in result.buckets]
    bucket = cluster.bucket(result.buckets[0].key)
    assert (bucket.state, bucket.worker_id) == ("succeeded", "w232@test")

    # A trace spec for the same release never reaches a queue: the release ships no torch-neuronx.
    trace = {**spec, "model": {**spec["model"], "format": "torchscript"}, "compiler": {}}
    with pytest.raises(SpecError, match=r"Neuron SDK 2\.32\.0 ships no torch-neuronx"):
        cluster.submit(trace)
