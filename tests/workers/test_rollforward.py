"""An operator rolls a fleet's artifacts forward: three artifacts built by a worker of one Neuron release
(the SDK double) are rebuilt by a worker of the next, through ``compilesvc rollforward`` against a running
API, relay and both workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from compilesvc.ledger.models import BucketCompile
from tests.doubles import neuron_double_env
from tests.fixtures.ports import free_port
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.workers.conftest import NEURON_SDK, Cluster

MakeCluster = Callable[..., Cluster]
NEXT_SDK = "2.25.0"


def cli(api: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_"))}
    env.update({"COMPILESVC_API_URL": api, "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN,
                "COMPILESVC_CONFIG": "/nonexistent/compilesvc.toml"})
    return subprocess.run([sys.executable, "-m", "compilesvc", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_three_artifacts_roll_forward_to_the_next_release(make_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = make_cluster()
    cluster.start_worker("w-old", concurrency=2)  # the cluster's environment: the double as NEURON_SDK
    cluster.start_worker("w-new", concurrency=2, env=neuron_double_env(cluster.env, sdk=NEXT_SDK))
    cluster.start_relay()
    port = free_port()
    cluster.start_api(port, workers=1)
    api = f"http://127.0.0.1:{port}"

    uri = cluster.upload(b"HloModuleProto rollforward", "model.hlo.pb")
    old_keys = []
    for buckets in (1, 2, 3):
        result = cluster.submit(cluster.hlo_spec("ok", buckets=buckets, uri=uri, labels={"fleet": "search"}))
        old_keys.append(result.artifact_key)
    for key in old_keys:
        cluster.wait_artifact(key, ("published",), timeout=120)

    plan = cli(api, "rollforward", "--from-sdk", NEURON_SDK, "--to-sdk", NEXT_SDK, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["items"]
    assert sorted(i["source_key"] for i in planned) == sorted(old_keys)
    assert {i["state"] for i in planned} == {"absent"}

    moved = cli(api, "rollforward", "--from-sdk", NEURON_SDK, "--to-sdk", NEXT_SDK, "--label", "fleet=search",
                "--json", "--timeout", "240")
    assert moved.returncode == 0, moved.stderr
    campaign = json.loads(moved.stdout)
    assert campaign["state"] == "finished"
    assert campaign["progress"] == {"total": 3, "submitted": 3, "building": 0, "built": 3, "hit": 0, "failed": 0,
                                    "cancelled": 0, "refused": 0}
    new_keys = [item["artifact_key"] for item in campaign["items"]]
    assert sorted(new_keys) == sorted(i["key"] for i in planned)
    for key in new_keys:
        artifact = cluster.artifact(key)
        assert artifact.state == "published" and artifact.sdk == NEXT_SDK
    with cluster.services.sessions() as session:
        new_buckets = session.query(BucketCompile).filter(BucketCompile.sdk == NEXT_SDK).all()
    assert len(new_buckets) == 3  # the three sets share their buckets: each compiled once
    assert {b.worker_id for b in new_buckets} == {"w-new@test"}  # compiled by the new release's worker
    assert all((b.versions or {}).get("neuron_sdk") == NEXT_SDK for b in new_buckets)

    # The campaign can be looked at again afterwards; the same roll-forward again is all hits.
    shown = cli(api, "campaigns", str(campaign["id"]))
    assert shown.returncode == 0 and "3 built" in shown.stderr, shown.stderr
    again = cli(api, "rollforward", "--from-sdk", NEURON_SDK, "--to-sdk", NEXT_SDK, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["progress"]["hit"] == 3
