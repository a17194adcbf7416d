"""A large S3 model is never hashed inside a request (compilesvc/pinning/hash_jobs.py), through the real API over
weed and both ledgers: the first submit answers 503 model-pinning with Retry-After and the progress, the hash
runs in the background once however many submits name the model, and the submit after it proceeds with the key
an inline hash gives; ``compilesvc submit`` waits through it, saying so on stderr."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from werkzeug.serving import make_server

from compilesvc.client.api import Api, ApiError
from compilesvc.ledger.models import PinJob
from tests.fixtures.s3server import S3Server
from tests.fixtures.waiting import wait_for
from tests.web.conftest import EnvFactory
from tests.web.support import Env, spec_for

LARGE = b"weights!" * (3 * 1024**2 // 16)  # 1.5 MiB: above the 1 MiB threshold set here


@pytest.fixture
def large_bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket("large")


@pytest.fixture
def s3_env(make_env: EnvFactory, ledger_url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch,
           large_bucket: str) -> Env:
    s3_server.use_as_credential_chain(monkeypatch)
    return make_env(ledger_url, s3_endpoint_url=s3_server.endpoint_url, s3_region=s3_server.region,
                    pin_inline_hash_max_mb=1, model_s3_prefixes={"*": [f"s3://{large_bucket}/"]})


@pytest.fixture
def large_model(s3_server: S3Server, large_bucket: str) -> str:
    bucket = large_bucket
    key = f"models/{uuid.uuid4().hex[:8]}/llama.pt"
    s3_server.raw_client().put_object(Bucket=bucket, Key=key, Body=LARGE)
    return f"s3://{bucket}/{key}"


def job_states(env: Env) -> list[str]:
    with env.services.sessions() as session:
        return list(session.scalars(select(PinJob.state)))


def test_a_large_model_answers_503_model_pinning_then_proceeds_with_the_inline_key(
        s3_env: Env, make_env: EnvFactory, sqlite_template: Path, tmp_path: Path, s3_server: S3Server,
        large_model: str, large_bucket: str) -> None:
    env = s3_env
    spec = spec_for(large_model)
    first = env.submit(spec)
    assert first.status_code == 503, first.get_data(as_text=True)
    assert first.mimetype == "application/problem+json" and first.headers["Retry-After"].isdigit()
    problem = first.json
    assert problem["type"] == "/problems/model-pinning"
    assert (problem["model"], problem["bytes_total"]) == (large_model, len(LARGE))
    assert problem["detail"].startswith(f"{large_model} is being hashed to pin it (")
    # The fleet's resolve of another large model, the first request naming it, waits alike.
    other = large_model.replace("llama.pt", "other.pt")
    s3_server.raw_client().put_object(Bucket=other.split("/")[2], Key=other.split("/", 3)[3], Body=LARGE + b"!")
    resolving = env.client.post("/v1/artifacts/resolve", json=spec_for(other))
    assert resolving.status_code == 503 and resolving.json["type"] == "/problems/model-pinning"
    assert resolving.headers["Retry-After"].isdigit()

    wait_for(lambda: job_states(env) == ["done", "done"], 60, "the background hashes")
    accepted = env.submit(spec)
    assert accepted.status_code == 202, accepted.get_data(as_text=True)
    build = env.client.get(f"/v1/builds/{accepted.json['build_id']}").json
    assert build["model_sha256"] == hashlib.sha256(LARGE).hexdigest()
    # The same key as an API that hashes the model inside the request (the default threshold, its own ledger).
    shutil.copyfile(sqlite_template, tmp_path / "inline.db")
    inline = make_env(f"sqlite:///{tmp_path / 'inline.db'}", s3_endpoint_url=s3_server.endpoint_url,
                      s3_region=s3_server.region, model_s3_prefixes={"*": [f"s3://{large_bucket}/"]})
    resolved = inline.client.post("/v1/artifacts/resolve", json=spec)
    assert resolved.status_code == 200, resolved.get_data(as_text=True)
    assert resolved.json["key"] == accepted.json["artifact_key"]
    assert job_states(inline) == []


def test_concurrent_submits_make_one_hash_job(s3_env: Env, large_model: str) -> None:
    env = s3_env
    clients = [env.app.test_client() for _ in range(2)]
    for client in clients:
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {env.token}"
    barrier = threading.Barrier(len(clients))
    statuses: list[int] = []
    body = json.dumps(spec_for(large_model))

    def submit(client: Any) -> None:
        barrier.wait()
        statuses.append(client.post("/v1/builds?queue_anyway=true", data=body,
                                    content_type="application/json").status_code)

    threads = [threading.Thread(target=submit, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 503 in statuses and set(statuses) <= {503, 202}
    wait_for(lambda: job_states(env) == ["done"], 60, "the background hash")
    assert env.submit(spec_for(large_model)).status_code == 202


@pytest.fixture
def served(s3_env: Env) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, s3_env.app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


def test_compilesvc_submit_waits_through_the_hash(s3_env: Env, served: str, large_model: str,
                                                  tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec_for(large_model)))
    done = subprocess.run(
        [sys.executable, "-m", "compilesvc", "submit", str(spec_path), "--api", served, "--no-wait",
         "--queue-anyway"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COMPILESVC_TOKEN": s3_env.token, "COMPILESVC_CONFIG": str(tmp_path / "none.toml")})
    assert done.returncode == 0, done.stderr
    assert f"waiting for the API to hash {large_model} to pin it (" in done.stderr
    build_id = int(done.stdout.strip())
    build = s3_env.client.get(f"/v1/builds/{build_id}").json
    assert build["model_sha256"] == hashlib.sha256(LARGE).hexdigest()
    assert job_states(s3_env) == ["done"]


def test_the_client_stops_waiting_at_its_own_deadline(s3_env: Env, served: str, large_model: str) -> None:
    told: list[dict[str, Any]] = []
    impatient = Api(served, token=s3_env.token, pinning_wait=0, on_pinning=told.append)
    with pytest.raises(ApiError) as raised:
        impatient.request("POST", "/v1/builds?queue_anyway=true", spec_for(large_model))
    assert (raised.value.status, raised.value.problem_type) == (503, "model-pinning")
    assert told == []  # no wait left: the answer is the caller's at once, not retried as an outage

    patient = Api(served, token=s3_env.token, on_pinning=told.append)
    accepted = patient.request("POST", "/v1/builds?queue_anyway=true", spec_for(large_model))
    build = patient.request("GET", f"/v1/builds/{accepted['build_id']}")
    assert build["model_sha256"] == hashlib.sha256(LARGE).hexdigest()
