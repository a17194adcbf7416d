"""A pool KEDA scales to zero wakes for a submit (issue 38, item 3).

With no worker alive, admission used to answer 503 ``no-capable-worker`` before writing a row, and KEDA's
query counts only rows (queued/running), so a pool at ``minReplicas: 0`` never woke. Now the queues the
chart's KEDA pools serve are rendered into ``COMPILESVC_SCALABLE_QUEUES`` and admitted with no worker alive;
the chart's own scaler query sees the compile; a worker started then (as KEDA would) compiles it. A queue no
pool serves is still refused with the reason.

KEDA's side is its documented arithmetic, not run here: the postgresql scaler activates a ScaledObject when
the query's value exceeds ``activationTargetQueryValue`` (keda.sh, "PostgreSQL" scaler and "Scaling
Deployments": activation phase), which the chart sets to 0.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from sqlalchemy import text

from compilesvc.refusals import NoCapableWorker
from compilesvc.states import BucketState
from tests.workers.conftest import NEURON_SDK, Cluster

pytestmark = pytest.mark.slow

chart = pytest.importorskip("tests.deploy.test_helm_chart", reason="the Helm SDK is not installed")


def _render_with_pool_at_zero(queue: str) -> tuple[str, str]:
    """The chart's COMPILESVC_SCALABLE_QUEUES and the new pool's scaler query, for the EKS example plus a
    KEDA pool at zero serving ``queue``."""
    values = copy.deepcopy(chart.values_of("eks-neuron-keda"))
    values["workers"]["pools"].append({
        "name": "double", "target": "inf2", "release": NEURON_SDK, "kinds": ["neuronx-cc"], "queues": [queue],
        "scaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 1, "pollingInterval": 10,
                    "cooldownPeriod": 600}})
    docs = chart.render(values)
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    scaled = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"].endswith("-double"))
    return config["data"]["COMPILESVC_SCALABLE_QUEUES"], scaled["spec"]["triggers"][0]["metadata"]["query"]


def test_a_pool_at_zero_accepts_a_submit_and_its_worker_compiles_it(make_cluster: Callable[..., Cluster]) -> None:
    plain = make_cluster()
    spec = plain.hlo_spec("ok")
    with pytest.raises(NoCapableWorker) as refused:  # the old behaviour, and still that of an unscaled queue
        plain.submit(spec)
    queue = refused.value.queue

    scalable, query = _render_with_pool_at_zero(queue)
    assert queue in scalable.split(",")
    # Every KEDA pool's queues are there, no fixed-replica pool's (the EKS example's cpu pool is fixed).
    for pool in chart.pools("eks-neuron-keda"):
        assert all((q in scalable.split(",")) == (pool["scaling"]["mode"] != "replicas") for q in pool["queues"])

    cluster = make_cluster(scalable_queues=scalable)
    result = cluster.submit(spec)  # no worker alive, no queue_anyway
    assert result.outcome == "new" and result.buckets[0].state == BucketState.QUEUED
    other = cluster.hlo_spec("ok", sdk="2.21.0")  # a queue no pool serves: refused, naming it
    with pytest.raises(NoCapableWorker, match=r"no live worker serves target inf2 with SDK 2\.21\.0"):
        cluster.submit(other)

    with cluster.services.engine.connect() as conn:  # what KEDA's postgresql scaler runs, as the chart renders it
        assert conn.execute(text(query)).scalar_one() == 1

    cluster.start_relay()
    cluster.start_worker("woken", concurrency=1, env={"COMPILESVC_NEURON_TARGETS": "inf2"})
    bucket = cluster.wait_bucket(result.buckets[0].key, (BucketState.SUCCEEDED,), timeout=90)
    assert bucket.queue == queue
    with cluster.services.engine.connect() as conn:
        assert conn.execute(text(query)).scalar_one() == 0  # and the pool may scale back to zero
