"""End to end over HTTP: a ``compilesvc serve`` API, two ``compilesvc worker`` processes, the relay, real
Postgres, Redis and a ``weed`` S3 server. A three-bucket spec compiles in parallel; the artifact is fetched
by key through presigned URLs, every sha256 is verified, and each compiled bucket is loaded and checked
against eager PyTorch."""

from __future__ import annotations

import hashlib
import io
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.ports import free_port as _free_port
from tests.fixtures.s3server import S3Server
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.workers.conftest import Cluster, wait_for

BUCKETS = [{"batch_size": 1, "seq_len": 16}, {"batch_size": 2, "seq_len": 32}, {"batch_size": 4, "seq_len": 64}]



def _overlaps(buckets: list[dict[str, Any]]) -> bool:
    spans = [(datetime.fromisoformat(b["started_at"]), datetime.fromisoformat(b["finished_at"])) for b in buckets]
    return any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:])


@pytest.mark.slow
def test_three_buckets_compile_in_parallel_and_serve_verified_artifacts(
    make_cluster: Any, s3_server: S3Server, tiny_torch_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)  # the in-process services (test assertions) talk to the same S3
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    bucket_name = s3_server.new_bucket("e2e")
    cluster: Cluster = make_cluster(store_url=f"s3://{bucket_name}/artifacts", extra_env=s3_server.env(),
                                    s3_endpoint_url=s3_server.endpoint_url, public_url=base,
                                    lease_seconds=30, heartbeat_seconds=1)
    cluster._start("api", ["serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"], None)
    http = requests.Session()
    http.headers.update(bearer(BOOTSTRAP_TOKEN))
    wait_for(lambda: _get_ok(http, f"{base}/readyz"), 60, "the API to be ready")
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=1)
    cluster.start_relay()

    # Upload the model through the API (streamed), then submit a three-bucket spec.
    model_bytes = tiny_torch_model.read_bytes()
    uploaded = http.post(f"{base}/v1/models", data=io.BytesIO(model_bytes),
                         headers={"Content-Type": "application/octet-stream"})
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["sha256"] == hashlib.sha256(model_bytes).hexdigest()
    spec = {"model": {"uri": uploaded.json()["uri"], "format": "exported-program", "name": "tiny"},
            "target": "cpu", "sdk": "2.13.0", "compiler": {"backend": "torchscript"}, "buckets": BUCKETS,
            "labels": {"pipeline": "e2e"}}
    submitted = http.post(f"{base}/v1/builds", json=spec)
    assert submitted.status_code == 202, submitted.text
    build_id, key = submitted.json()["build_id"], submitted.json()["artifact_key"]

    # Watch it: more than one bucket runs at once.
    most_running = 0
    deadline = time.monotonic() + 300
    while True:
        build = http.get(f"{base}/v1/builds/{build_id}").json()
        most_running = max(most_running, sum(b["state"] == "running" for b in build["buckets"]))
        if build["state"] != "building" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert build["state"] == "succeeded", build
    assert most_running >= 2 or _overlaps(build["buckets"]), build["buckets"]
    assert _overlaps(build["buckets"]), "bucket compiles did not overlap in time"
    assert {b["attempts"] for b in build["buckets"]} == {1}

    logs = http.get(f"{base}/v1/builds/{build_id}/logs", params={"after": 0, "limit": 5000}).json()
    assert {line["bucket_key"] for line in logs["lines"]} == {b["key"] for b in build["buckets"]}

    # Fetch by key, verify every file through its presigned URL, load each bucket and compare with eager.
    artifact = http.get(f"{base}/v1/artifacts/{key}")
    assert artifact.status_code == 200, artifact.text
    manifest = artifact.json()
    assert manifest["key"] == key and len(manifest["buckets"]) == 3
    eager = torch.export.load(str(tiny_torch_model)).module()
    generator = torch.Generator().manual_seed(7)
    for bucket in manifest["buckets"]:
        assert bucket["versions"]["torch"].startswith("2.13.0")
        for entry in [*bucket["files"], bucket["log"]]:
            body = requests.get(entry["url"], timeout=30)
            assert body.status_code == 200, entry["url"]
            assert len(body.content) == entry["size"]
            assert hashlib.sha256(body.content).hexdigest() == entry["sha256"]
        (model_entry,) = [f for f in bucket["files"] if f["role"] == "model"]
        compiled = torch.jit.load(io.BytesIO(requests.get(model_entry["url"], timeout=30).content))
        shape = bucket["inputs"][0]["shape"]
        ids = torch.randint(0, 100, shape, generator=generator)
        mask = torch.ones(shape, dtype=torch.int64)
        torch.testing.assert_close(compiled(ids, mask), eager(ids, mask), rtol=1e-4, atol=1e-5)

    # The same spec again is a hit, answered with the artifact.
    again = http.post(f"{base}/v1/builds", json=spec)
    assert again.status_code == 200 and again.json()["outcome"] == "hit"

    # Signed by the publishing side's key (generated in the cluster's data dir, shared by its processes).
    from compilesvc.signing.artifacts import verify_artifact
    from compilesvc.signing.keys import GENERATED_KEY_NAME, SigningKey, TrustedKeys
    from compilesvc.spec.manifest import parse_artifact_manifest

    key_file = cluster.settings.data_dir / GENERATED_KEY_NAME
    signing = SigningKey.load(key_file)
    for entry_list in (b["files"] + [b["log"]] for b in manifest["buckets"]):
        for entry in entry_list:
            entry.pop("url")
    manifest.pop("urls_expire_in")
    signature = http.get(f"{base}/v1/artifacts/{key}/signature")
    assert signature.status_code == 200
    verified = verify_artifact(TrustedKeys({signing.key_id: signing.public_key}), signature.content,
                               parse_artifact_manifest(json.dumps(manifest).encode(), key))
    assert verified.key_id == signing.key_id


def _get_ok(http: requests.Session, url: str) -> bool:
    try:
        return http.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False
