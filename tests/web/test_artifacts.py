"""GET /v1/artifacts/{key} (the cached hot path), POST /v1/artifacts/resolve, and both on an S3 store."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import event, func, select

from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.ledger.models import Artifact, Base, utcnow
from compilesvc.lifecycle.fetch_stats import FetchRecorder
from compilesvc.store.base import artifact_manifest_name
from compilesvc.store.local import LocalStore
from tests.fixtures.ports import free_port
from tests.fixtures.tokens import bearer, make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem
from web.contract.schemas import ArtifactOut, ResolveOut


@contextmanager
def count_queries(env: Env) -> Iterator[list[str]]:
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(env.services.engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(env.services.engine, "before_cursor_execute", record)


def row_counts(env: Env) -> dict[str, int]:
    with env.services.sessions() as session:
        return {t.name: session.scalar(select(func.count()).select_from(t)) or 0 for t in Base.metadata.sorted_tables}


def published(env: Env, uri: str | None = None, **spec_kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = spec_for(uri or env.upload(), **spec_kwargs)
    build = env.submit(spec).json
    complete_build(env.services, build["build_id"])
    return spec, build


def test_artifact_lookup_and_cache(env: Env) -> None:
    _, build = published(env)
    key = build["artifact_key"]
    with count_queries(env) as cold:
        first = env.client.get(f"/v1/artifacts/{key}")
    assert first.status_code == 200 and cold, "a cold lookup asks the ledger"
    artifact = ArtifactOut.model_validate(first.json)
    assert artifact.key == key and artifact.urls_expire_in == env.settings.url_ttl_seconds
    assert [b.position for b in artifact.buckets] == [0, 1]
    assert artifact.buckets[0].versions == {"torch": "2.13.0", "compilesvc": "0.1.0"}
    assert artifact.buckets[0].compile_seconds == 1.5
    assert artifact.size_bytes == sum(f.size for b in artifact.buckets for f in b.files) + sum(
        b.log.size for b in artifact.buckets if b.log) or artifact.size_bytes > 0

    with count_queries(env) as warm:
        second = env.client.get(f"/v1/artifacts/{key}")
    assert second.status_code == 200
    assert warm == [], "a cached manifest needs no database query"
    # Reusable for half the URLs' lifetime: a URL in a reused answer still has that long to run.
    assert second.headers["Cache-Control"] == f"private, max-age={env.settings.url_ttl_seconds // 2}, immutable"
    etag = second.headers["ETag"]
    assert etag.startswith('W/"') and first.headers["ETag"] == etag  # the same manifest, other URLs
    # URLs are signed per request; the manifest is the same.
    assert {k: v for k, v in second.json.items() if k != "buckets"} == {
        k: v for k, v in first.json.items() if k != "buckets"}


def test_if_none_match_answers_304_for_the_same_manifest_only(env: Env) -> None:
    _, build = published(env)
    _, other = published(env, buckets=((4, 8),))
    key = build["artifact_key"]
    etag = env.client.get(f"/v1/artifacts/{key}").headers["ETag"]
    for sent in (etag, etag.removeprefix("W/"), f'"nope", {etag}', "*"):
        with count_queries(env) as queries:
            again = env.client.get(f"/v1/artifacts/{key}", headers={"If-None-Match": sent})
        assert again.status_code == 304 and again.data == b"" and queries == [], sent
        assert again.headers["ETag"] == etag
    other_etag = env.client.get(f"/v1/artifacts/{other['artifact_key']}").headers["ETag"]
    assert other_etag != etag
    changed = env.client.get(f"/v1/artifacts/{key}", headers={"If-None-Match": other_etag})
    assert changed.status_code == 200 and changed.json["key"] == key
    # A miss is a miss whatever the client holds.
    assert_problem(env.client.get("/v1/artifacts/" + "0" * 64, headers={"If-None-Match": "*"}), 404,
                   "artifact-not-found")


def test_a_key_absent_everywhere_is_answered_from_memory_for_a_moment(make_env: EnvFactory, sqlite_url: str,
                                                                      sqlite_template: Path, tmp_path: Path) -> None:
    """A fleet polling for a key nobody built costs an indexed ledger query, not a store read; a manifest
    published by another region into the same store shows once the remembered absence runs out."""
    region_a = make_env(sqlite_url)
    _, build = published(region_a)
    key = build["artifact_key"]
    other_ledger = tmp_path / "region-b.db"  # a ledger that never heard of the key
    shutil.copyfile(sqlite_template, other_ledger)
    region_b = make_env(f"sqlite:///{other_ledger}", store_url=region_a.settings.store_url,
                        config={"ABSENT_ARTIFACT_SECONDS": 1.0})
    store = region_a.services.store
    assert isinstance(store, LocalStore)
    path = store.root / artifact_manifest_name(key)
    moved = tmp_path / "moved-manifest"
    path.rename(moved)
    assert_problem(region_b.client.get(f"/v1/artifacts/{key}"), 404, "artifact-not-found")
    moved.rename(path)  # "published by another region" while region B remembers the miss
    assert_problem(region_b.client.get(f"/v1/artifacts/{key}"), 404, "artifact-not-found")
    time.sleep(1.1)
    assert region_b.client.get(f"/v1/artifacts/{key}").status_code == 200


def test_artifact_not_published_or_unknown(env: Env) -> None:
    build = env.submit(spec_for(env.upload())).json
    body = assert_problem(env.client.get(f"/v1/artifacts/{build['artifact_key']}"), 404, "artifact-not-published")
    assert body["state"] == "building"
    assert "building" in body["detail"]
    assert_problem(env.client.get("/v1/artifacts/" + "0" * 64), 404, "artifact-not-found")
    assert_problem(env.client.get("/v1/artifacts/not-a-key"), 404)  # not a key: no such resource
    assert_problem(env.client.get("/v1/artifacts/resolve"), 405)  # resolve is POST only, not a key
    assert_problem(env.client.post("/v1/artifacts/" + "0" * 64), 405)


def test_a_manifest_that_does_not_match_its_key_is_never_served(env: Env) -> None:
    """A foreign document under a key's name (a copy, a bug, tampering): refused on every path, no 500."""
    _, build = published(env)
    uri = env.upload(b"another model")
    other = env.client.post("/v1/artifacts/resolve", json=spec_for(uri)).json["key"]
    store = env.services.store
    genuine = store.read_document(artifact_manifest_name(build["artifact_key"]))
    assert genuine is not None and store.create_document(artifact_manifest_name(other), genuine)
    before = row_counts(env)

    body = assert_problem(env.client.get(f"/v1/artifacts/{other}"), 503, "store-integrity")
    assert body["key"] == other
    assert_problem(env.submit(spec_for(uri)), 503, "store-integrity")
    assert row_counts(env) == before  # the submit recorded nothing


def test_resolve_never_creates_rows(env: Env) -> None:
    uri = env.upload()
    spec = spec_for(uri, buckets=((1, 8), (1, 8), (4, 16)))
    before = row_counts(env)
    response = env.client.post("/v1/artifacts/resolve", json=spec)
    assert response.status_code == 200
    resolved = ResolveOut.model_validate(response.json)
    assert resolved.state == "absent" and resolved.artifact is None
    assert [b.position for b in resolved.buckets] == [0, 1, 2]
    assert resolved.buckets[0].key == resolved.buckets[1].key  # same shape, same compile
    assert {b.state for b in resolved.buckets} == {"absent"}
    assert resolved.model.uri == uri and resolved.model.size > 0
    assert set(resolved.components) >= {"model", "toolchain", "flags", "buckets"}
    assert row_counts(env) == before

    submitted = env.submit(spec).json
    assert submitted["artifact_key"] == resolved.key, "resolve and submit agree on the key"
    building = ResolveOut.model_validate(env.client.post("/v1/artifacts/resolve", json=spec).json)
    assert building.state == "building" and {b.state for b in building.buckets} == {"queued"}

    complete_build(env.services, submitted["build_id"])
    before = row_counts(env)
    done = ResolveOut.model_validate(env.client.post("/v1/artifacts/resolve", json=spec).json)
    assert done.state == "published" and done.artifact is not None and done.artifact.key == resolved.key
    assert row_counts(env) == before

    assert_problem(env.client.post("/v1/artifacts/resolve", json={"target": "cpu"}), 422, "spec-invalid")
    assert_problem(env.client.post("/v1/artifacts/resolve", data=b"nope", content_type="application/json"), 400,
                   "invalid-json")
    missing = spec_for("blob:sha256:" + "cd" * 32)
    assert_problem(env.client.post("/v1/artifacts/resolve", json=missing), 422, "model-ref-invalid")


def test_s3_store_end_to_end(s3_env: Env) -> None:
    env = s3_env
    model = b"model bytes in S3" * 100
    uri = env.upload(model)
    assert uri == "blob:sha256:" + hashlib.sha256(model).hexdigest()
    _, build = published(env, uri)
    hit = env.submit(spec_for(uri)).json
    assert hit["outcome"] == "hit"
    artifact = ArtifactOut.model_validate(env.client.get(f"/v1/artifacts/{build['artifact_key']}").json)
    entry = artifact.buckets[0].files[0]
    assert entry.url.startswith(env.settings.s3_endpoint_url or "http")
    download = requests.get(entry.url, timeout=30)
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == entry.sha256
    assert "model.pt" in download.headers.get("Content-Disposition", "")
    # Blobs of an S3 store are never served by the API.
    assert_problem(env.client.get(f"/v1/blobs/{entry.sha256}?expires=1&sig={'0' * 64}"), 404, "blob-not-found")


def test_cached_rendering_equals_describe(sqlite_env: Env) -> None:
    """The hot path lays a manifest out once and signs fresh URLs into it; it must say what describe() says."""
    env = sqlite_env
    _, build = published(env)
    ctx = env.app.extensions["compilesvc"]
    entry = ctx.published(build["artifact_key"])
    rendered = json.loads(ctx.describe_json(entry))
    plain = ctx.describe(entry.manifest)

    def without_urls(document: Any) -> Any:
        if isinstance(document, dict):
            return {k: without_urls(v) for k, v in document.items() if k != "url"}
        if isinstance(document, list):
            return [without_urls(v) for v in document]
        return document

    assert without_urls(rendered) == without_urls(plain)
    for bucket in rendered["buckets"]:
        for entry_file in [*bucket["files"], bucket["log"]]:
            download = env.client.get(entry_file["url"].removeprefix(env.settings.public_url))
            assert hashlib.sha256(download.data).hexdigest() == entry_file["sha256"]


def test_renders_are_reused_within_a_second_only(sqlite_env: Env, monkeypatch: Any) -> None:
    import time as time_module

    env = sqlite_env
    _, build = published(env)
    now = [1_900_000_000.2]
    monkeypatch.setattr(time_module, "time", lambda: now[0])  # the store's clock and the cache's
    first = env.client.get(f"/v1/artifacts/{build['artifact_key']}").get_data(as_text=True)
    now[0] += 0.5
    assert env.client.get(f"/v1/artifacts/{build['artifact_key']}").get_data(as_text=True) == first
    store = env.services.store
    url = json.loads(first)["buckets"][0]["files"][0]["url"]
    assert url == store.blob_url(json.loads(first)["buckets"][0]["files"][0]["sha256"],
                                 expires_in=env.settings.url_ttl_seconds, filename="model.pt"), \
        "a reused render is exactly what signing now would give"
    now[0] += 1.0
    later = json.loads(env.client.get(f"/v1/artifacts/{build['artifact_key']}").get_data(as_text=True))
    entry = later["buckets"][0]["files"][0]
    assert entry["url"] != url, "a new second signs again"
    assert entry["url"] == store.blob_url(entry["sha256"], expires_in=env.settings.url_ttl_seconds,
                                          filename="model.pt")


def test_lookups_are_counted_without_a_write_each_and_written_in_a_batch(env: Env) -> None:
    _, build = published(env)
    key = build["artifact_key"]
    etag = env.client.get(f"/v1/artifacts/{key}").headers["ETag"]
    with count_queries(env) as queries:
        for _ in range(4):
            assert env.client.get(f"/v1/artifacts/{key}").status_code == 200
        assert env.client.get(f"/v1/artifacts/{key}", headers={"If-None-Match": etag}).status_code == 304
    assert queries == []  # the fleet's lookup never writes
    recorder = env.app.extensions["compilesvc"].fetches
    assert recorder.flush() == 1  # one UPDATE for the one artifact, whatever the lookups
    with env.services.sessions() as session:
        count, last = session.execute(select(Artifact.fetch_count, Artifact.last_fetched_at)
                                      .where(Artifact.key == key)).one()
    assert count == 6 and last is not None and abs((utcnow() - last).total_seconds()) < 60
    assert recorder.flush() == 0  # nothing new


def test_counts_the_ledger_could_not_take_are_kept_for_the_next_write(env: Env) -> None:
    _, build = published(env)
    key = build["artifact_key"]
    unreachable = make_sessionmaker(make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none"))
    recorder = FetchRecorder(unreachable, interval=3600)
    recorder.record(key)
    recorder.record(key)
    assert recorder.flush() == 0
    recorder.sessions = env.services.sessions  # the ledger is back
    assert recorder.flush() == 1
    with env.services.sessions() as session:
        assert session.scalar(select(Artifact.fetch_count).where(Artifact.key == key)) == 2


# Found by python -m bench.fuzz (a fleet token, negative mode): the model's S3 server cannot be reached (here:
# no credentials), which is a 503 store-unavailable the operation did not document.
FUZZ_RESOLVE_BODY = (
    '{"model": {"format": "torchscript", "version_id": "4K\\u001c\\u00db\\u00b7\\\\X\\u008e;\\u00de~x\\uda0c\\udc26'
    '\\b&\\u008d", "uri": "s3://qkju6wb.ar1k/~\\u0007\\u00ba\\u018f\\u00e5?cN\\u00a3e;", "name": null}, '
    '"target": "cpu", "labels": {"VkF\\u0081t\\u008d\\f_2u\\u0094\\u0017\\u0091^": ""}, '
    '"buckets": [{"batch_size": 131072, "seq_len": 18982}, {"batch_size": 5547.0, "seq_len": 11222.0}], '
    '"callbacks": ["http://\\u00bb\\uda3c\\udcc2nCg"], "sdk": "4005092.2.49462"}')


def test_resolving_a_model_on_an_unreachable_s3_is_a_documented_503(
        make_env: EnvFactory, sqlite_url: str, tmp_path: Path, monkeypatch: Any) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role either: no credentials at all
    env = make_env(sqlite_url, model_s3_prefixes={"serving": ["s3://qkju6wb.ar1k"]})  # the fleet team may read it
    fleet = make_token(env.services.sessions, "fleet", owner="serving")
    response = env.client.post("/v1/artifacts/resolve", data=FUZZ_RESOLVE_BODY, content_type="application/json",
                               headers=bearer(fleet))
    body = assert_problem(response, 503, "store-unavailable")
    assert "s3://qkju6wb.ar1k/" in body["detail"] and response.headers["Retry-After"].isdigit()
    documented = env.client.get("/openapi.json").json["paths"]["/v1/artifacts/resolve"]["post"]["responses"]
    assert "503" in documented and "Retry-After" in documented["503"]["headers"]


def test_every_operation_that_reads_the_ledger_or_store_documents_503(sqlite_env: Env) -> None:
    """A token is checked in the ledger and a signed URL's blob is in the store: when either is away, any such
    operation answers 503 (tests/web/test_system.py's ledger outage), so each one documents it."""
    for path, item in sqlite_env.client.get("/openapi.json").json["paths"].items():
        for method, op in item.items():
            needs_token = op["security"] and {} not in op["security"]
            if needs_token or path == "/v1/blobs/{sha256}":
                assert "503" in op["responses"], (method, path)


def test_a_model_uri_holding_nul_is_refused_as_the_document_says(sqlite_env: Env) -> None:
    """Every JSON body's text is refused with a NUL in it; the spec's URI pattern says so too (it used to
    allow any character after an S3 bucket or in a file path)."""
    env = sqlite_env
    schemas = env.client.get("/openapi.json").json["components"]["schemas"]
    pattern = schemas["ModelRef"]["properties"]["uri"]["pattern"]
    for uri in ("s3://bucket/a\x00b", "file:///models/a\x00b"):
        assert re.search(pattern, uri) is None and re.search(pattern, uri.replace("\x00", "_"))
        spec = {**spec_for("blob:sha256:" + "0" * 64), "model": {"uri": uri, "format": "torchscript"}}
        assert_problem(env.client.post("/v1/artifacts/resolve", json=spec), 422)
