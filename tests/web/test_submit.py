"""POST /v1/builds on both ledgers: new, join and hit; idempotency; capacity; and every way a body is refused.

Artifacts are published without a compiler through the worker's ledger paths (see tests/web/support.py).
"""

from __future__ import annotations

import hashlib
import io
import json

import pytest
from sqlalchemy import func, select
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request

from compilesvc.ledger.models import Build
from compilesvc.store.base import artifact_manifest_name
from tests.fixtures.tokens import bearer, make_token
from tests.web.support import PUBLIC_URL, Env, complete_build, spec_for
from web.api.params import parse_for_service
from web.contract.schemas import ArtifactOut, BuildAccepted, BuildOut, ProblemDetails


def assert_problem(response, status: int, type_suffix: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    body = response.json
    ProblemDetails.model_validate(body)
    assert body["status"] == status
    if type_suffix is not None:
        assert body["type"] == f"/problems/{type_suffix}"
    return body


def test_new_join_hit(env: Env) -> None:
    spec = spec_for(env.upload(), labels={"team": "vision"})

    # The submitter is the token's owner (no header can claim another name).
    pipeline = make_token(env.services.sessions, "submit", owner="ci-pipeline-17")
    new = env.submit(spec, **bearer(pipeline), **{"X-Submitted-By": "someone-else"})
    assert new.status_code == 202
    body = BuildAccepted.model_validate(new.json)
    assert body.outcome == "new" and body.state == "building" and body.artifact_state == "building"
    assert [b.position for b in body.buckets] == [0, 1]
    assert all(b.state == "queued" for b in body.buckets)
    assert new.headers["Location"] == body.status_url == f"{PUBLIC_URL}/v1/builds/{body.build_id}"
    assert body.logs_url == f"{PUBLIC_URL}/v1/builds/{body.build_id}/logs"
    assert body.artifact is None

    join = env.submit(spec)
    assert join.status_code == 202
    assert join.json["outcome"] == "join"
    assert join.json["artifact_key"] == body.artifact_key
    assert join.json["build_id"] != body.build_id

    complete_build(env.services, body.build_id)

    hit = env.submit(spec)
    assert hit.status_code == 200
    accepted = BuildAccepted.model_validate(hit.json)
    assert accepted.outcome == "hit" and accepted.state == "succeeded"
    assert accepted.artifact is not None and accepted.artifact.key == body.artifact_key
    files = [f for bucket in accepted.artifact.buckets for f in bucket.files]
    assert len(files) == 2 and all(f.url.startswith(f"{PUBLIC_URL}/v1/blobs/") for f in files)

    # Both earlier builds followed the artifact; the submitter and labels were recorded.
    for build_id in (body.build_id, join.json["build_id"]):
        status = env.client.get(f"/v1/builds/{build_id}")
        detail = BuildOut.model_validate(status.json)
        assert detail.state == "succeeded" and detail.artifact is not None
    first = env.client.get(f"/v1/builds/{body.build_id}").json
    assert first["submitted_by"] == "ci-pipeline-17"
    assert first["labels"] == {"team": "vision"}
    assert [e["to_state"] for e in first["events"] if e["entity"] == "build"] == ["building", "succeeded"]


def test_hit_urls_download_the_files(sqlite_env: Env) -> None:
    env = sqlite_env
    build = env.submit(spec_for(env.upload(), buckets=((1, 4),))).json
    complete_build(env.services, build["build_id"])
    artifact = ArtifactOut.model_validate(env.client.get(f"/v1/artifacts/{build['artifact_key']}").json)
    entry = artifact.buckets[0].files[0]
    url = entry.url.removeprefix(PUBLIC_URL)
    download = env.client.get(url)
    assert download.status_code == 200
    assert hashlib.sha256(download.data).hexdigest() == entry.sha256
    assert len(download.data) == entry.size
    assert download.headers["Content-Disposition"] == 'attachment; filename="model.pt"'


def test_idempotency_key(env: Env) -> None:
    spec = spec_for(env.upload())
    first = env.submit(spec, **{"Idempotency-Key": "ci-run-42"})
    again = env.submit(spec, **{"Idempotency-Key": "ci-run-42"})
    assert first.status_code == again.status_code == 202
    assert again.json["build_id"] == first.json["build_id"]
    assert again.json["replayed"] is True and again.headers["Idempotent-Replayed"] == "true"

    different = dict(spec, labels={"other": "body"})
    conflict = env.submit(different, **{"Idempotency-Key": "ci-run-42"})
    body = assert_problem(conflict, 422, "idempotency-key-reused")
    assert "ci-run-42" in body["detail"]
    with env.services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Build)) == 1


def test_no_capable_worker_is_503_unless_queue_anyway(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = spec_for(env.upload())
    refused = env.submit(spec, queue_anyway=False)
    body = assert_problem(refused, 503, "no-capable-worker")
    assert body["queue"] == "compile.cpu.2.13.0"
    assert refused.headers["Retry-After"]
    assert env.submit(spec, queue_anyway=True).status_code == 202
    assert_problem(env.client.post("/v1/builds?queue_anyway=maybe", json=spec), 400, "invalid-request")


def test_spec_errors_are_422_with_fields(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = spec_for(env.upload())
    spec["target"] = "tpu"
    spec["buckets"] = [{"batch_size": 0, "seq_len": 8}]
    spec["surprise"] = 1
    body = assert_problem(env.submit(spec), 422, "spec-invalid")
    fields = {e["field"] for e in body["errors"]}
    assert {"target", "buckets[0].batch_size", "surprise"} <= fields

    not_object = assert_problem(env.client.post("/v1/builds", json=[1, 2]), 422, "spec-invalid")
    assert not_object["errors"] == [{"field": "", "message": "expected a JSON object"}]

    nul = spec_for(env.upload(), labels={"team": "a\u0000b"})
    nul_body = assert_problem(env.submit(nul), 422, "spec-invalid")
    assert nul_body["errors"][0]["field"] == "labels.team"


def test_impossible_shapes_are_422_before_anything_is_queued(make_env, ledger_url: str) -> None:  # type: ignore[no-untyped-def]
    env = make_env(ledger_url)
    spec = spec_for(env.upload())
    # The field report's bucket: 2**160 elements, once accepted and failed three times as "infra".
    spec["buckets"].append({"inputs": [{"name": "x", "shape": [1048576] * 8, "dtype": "float32"}]})
    body = assert_problem(env.submit(spec), 422, "spec-invalid")
    assert body["errors"] == [{"field": "buckets[2].inputs[0].shape", "message": (
        f"{1048576**8} elements per input; at most {2**34} are accepted (max_elements_per_input)")}]
    assert_problem(env.client.post("/v1/artifacts/resolve", json=spec), 422, "spec-invalid")
    with env.services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Build)) == 0

    # A long-context LLM bucket is within the defaults.
    spec["buckets"][2] = {"inputs": [{"name": "input_ids", "shape": [64, 32768], "dtype": "int64"},
                                     {"name": "hidden", "shape": [64, 32768, 8192], "dtype": "bfloat16"}]}
    assert env.submit(spec).status_code == 202

    # The bounds are settings; a tighter one refuses what the default accepts.
    tight = make_env(ledger_url, max_elements_per_input=1024, max_elements_per_bucket=1024)
    small = spec_for(tight.upload(), buckets=((1, 8), (4, 256)))
    body = assert_problem(tight.submit(small), 422, "spec-invalid")
    assert [e["field"] for e in body["errors"]] == ["buckets[1]"]
    assert "2048 elements in the bucket" in body["errors"][0]["message"]  # 1024 per input is allowed
    small["buckets"][1] = {"batch_size": 2, "seq_len": 256}  # 512 per input, 1024 together: at the limit
    assert tight.submit(small).status_code == 202


def test_model_ref_errors_are_422(sqlite_env: Env) -> None:
    env = sqlite_env
    missing = spec_for("blob:sha256:" + "ab" * 32)
    body = assert_problem(env.submit(missing), 422, "model-ref-invalid")
    assert body["errors"][0]["field"] == "model.uri"
    file_model = spec_for("file:///etc/hostname")
    assert_problem(env.submit(file_model), 422, "model-ref-invalid")


@pytest.mark.parametrize("raw, detail", [
    (b"{not json", "line 1 column 2"),
    (b"", "empty"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_invalid_json_is_400(sqlite_env: Env, raw: bytes, detail: str) -> None:
    response = sqlite_env.client.post("/v1/builds", data=raw, content_type="application/json")
    body = assert_problem(response, 400, "invalid-json")
    assert detail in body["detail"]


def test_body_over_limit_is_413(make_env, sqlite_url: str) -> None:  # type: ignore[no-untyped-def]
    env = make_env(sqlite_url, max_request_bytes=4096)
    big = json.dumps(spec_for(env.upload(), labels={"pad": "x" * 1000, "pad2": "y" * 1000, "p3": "z" * 1000,
                                                   "p4": "w" * 1000}))
    body = assert_problem(env.client.post("/v1/builds", data=big, content_type="application/json"), 413,
                          "request-too-large")
    assert body["max_bytes"] == 4096
    # The limit holds on endpoints that never read a body, too.
    assert_problem(env.client.get("/v1/builds", data=b"x" * 5000), 413)
    # And for a body without Content-Length (chunked), where the limit cuts the read.
    environ = EnvironBuilder(path="/v1/builds", method="POST", content_type="application/json").get_environ()
    environ["wsgi.input"] = io.BytesIO(big.encode())
    environ.pop("CONTENT_LENGTH", None)
    environ["wsgi.input_terminated"] = True
    assert_problem(env.client.open(Request(environ)), 413, "request-too-large")


def test_header_validation(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = spec_for(env.upload())
    body = assert_problem(env.submit(spec, **{"Idempotency-Key": "k" * 256}), 400, "invalid-request")
    assert body["errors"][0]["field"] == "header Idempotency-Key"


def test_only_small_blob_submits_are_kept_prepared(env: Env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Resubmitted bodies skip parsing and keys, but the cache holds no large bodies: a client could fill it."""
    prepared = env.app.extensions["compilesvc"].prepared
    uri = env.upload()
    small = spec_for(uri)
    for _ in range(2):
        assert env.submit(small).status_code == 202
    assert len(prepared) == 1

    large = spec_for(uri, labels={f"l{i}": "x" * 1000 for i in range(10)})  # valid, over 8 KiB as JSON
    assert env.submit(large).status_code == 202
    assert len(prepared) == 1


def test_200_means_a_hit_and_nothing_else(env: Env) -> None:
    uri = env.upload()
    first = env.submit(spec_for(uri, buckets=((1, 8), (2, 8))))
    complete_build(env.services, first.json["build_id"])
    # A subset of those buckets is another set (another key): new, though nothing is left to compile and it
    # is published at once. It says so in a 202, not in the hit's 200.
    subset = env.submit(spec_for(uri, buckets=((2, 8),)))
    assert subset.status_code == 202 and subset.json["outcome"] == "new", subset.json
    assert subset.json["state"] == "succeeded" and subset.json["artifact"] is not None
    assert subset.headers["Location"] == subset.json["status_url"]
    again = env.submit(spec_for(uri, buckets=((2, 8), (2, 8))))  # a duplicated bucket: the same set again
    assert again.status_code == 200 and again.json["outcome"] == "hit"
    assert again.json["artifact_key"] == subset.json["artifact_key"]


def test_numbers_python_cannot_convert_are_named(env: Env) -> None:
    body = '{"model": {"uri": "x"}, "sdk": ' + "9" * 5000 + "}"
    problem = assert_problem(env.client.post("/v1/builds", data=body, content_type="application/json"), 400,
                             "invalid-json")
    assert "more than 4300 digits" in problem["detail"]


def test_a_hit_reads_the_manifest_from_the_process_cache_not_the_store(sqlite_env: Env) -> None:
    # Found by profiling cache-hit submits (issue 12): the submitter was given the process's manifest cache
    # but, the cache being empty (len 0, falsy) when the app started, read every hit's manifest from the
    # store instead. A hit must cost no store read once its manifest is cached: shown here by taking the
    # manifest document away from the store after the first hit.
    env = sqlite_env
    spec = spec_for(env.upload(), buckets=((1, 4),))
    build = env.submit(spec).json
    complete_build(env.services, build["build_id"])
    assert env.submit(spec).status_code == 200  # the first hit caches the manifest
    ctx = env.app.extensions["compilesvc"]
    assert ctx.submitter.manifests is ctx.manifests
    manifest_path = env.services.store._document_path(artifact_manifest_name(build["artifact_key"]))
    manifest_path.unlink()
    with env.app.test_request_context():
        prepared = ctx.submitter.prepare(parse_for_service(spec, env.services.settings))
    result = ctx.submitter.submit(prepared, principal=None, idempotency_key=None, queue_anyway=False)
    assert result.outcome == "hit"
    assert result.manifest is not None and result.manifest.key == build["artifact_key"]
