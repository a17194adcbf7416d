"""Retention and garbage collection on both stores: a dry run lists exactly what the real run then deletes;
pinned, recently fetched, young and in-flight artifacts (and the buckets they share) are untouched; a
deleted artifact answers 404 and builds again when resubmitted; a second run finds nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, utcnow
from compilesvc.ledger.retention import GcDeletion, GcRun
from compilesvc.lifecycle import retention
from compilesvc.store.base import (
    artifact_manifest_name,
    artifact_provenance_name,
    artifact_signature_name,
    bucket_manifest_name,
)
from tests.fixtures.s3server import S3Server
from tests.web.conftest import (
    EnvFactory,
    make_env,  # noqa: F401  (the fixture)
)
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store_env(request: pytest.FixtureRequest, make_env: EnvFactory, sqlite_url: str,  # noqa: F811
              monkeypatch: pytest.MonkeyPatch) -> Env:
    if request.param == "local":
        return make_env(sqlite_url)
    s3: S3Server = request.getfixturevalue("s3_server")
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return make_env(sqlite_url, store_url=f"s3://{s3.new_bucket('gc')}/artifacts", s3_endpoint_url=s3.endpoint_url)


def publish(env: Env, model: bytes, **spec: Any) -> dict[str, Any]:
    build = env.submit(spec_for(env.upload(model), **spec)).json
    complete_build(env.services, build["build_id"])
    return dict(build)


def age(env: Env, key: str, *, days: float, fetched_days_ago: float | None = None) -> None:
    with transaction(env.services.sessions) as session:
        session.execute(update(Artifact).where(Artifact.key == key).values(
            published_at=utcnow() - timedelta(days=days), created_at=utcnow() - timedelta(days=days),
            last_fetched_at=None if fetched_days_ago is None else utcnow() - timedelta(days=fetched_days_ago)))


def files_of(env: Env, key: str) -> dict[str, set[str]]:
    """Every store object an artifact needs: its manifest, its buckets' manifests and files (by bucket key)."""
    manifest = json.loads(env.services.store.read_document(artifact_manifest_name(key)) or b"{}")
    return {b["key"]: {f["sha256"] for f in [*b["files"], b["log"]] if f} for b in manifest.get("buckets", [])}


def whole(env: Env, key: str, files: dict[str, set[str]]) -> bool:
    store = env.services.store
    return (store.read_document(artifact_manifest_name(key)) is not None
            and store.read_document(artifact_signature_name(key)) is not None
            and all(store.read_document(bucket_manifest_name(b)) is not None for b in files)
            and all(store.has_blob(sha) for shas in files.values() for sha in shas))


def test_a_dry_run_lists_exactly_what_the_real_run_deletes(store_env: Env) -> None:
    env = store_env
    released = publish(env, b"old model", buckets=((1, 8), (2, 8)))
    shared_in_flight = env.submit(spec_for(env.upload(b"old model"), buckets=((1, 8), (4, 8)))).json  # shares (1, 8)
    pinned_key = publish(env, b"pinned by key")
    pinned_model = publish(env, b"pinned by model", name="keep-this-model")
    pinned_label = publish(env, b"pinned by label", labels={"fleet": "search"})
    fetched = publish(env, b"fetched lately")
    young = publish(env, b"young model")
    retired = publish(env, b"retired release", sdk="2.12.0")
    for build in (released, pinned_key, pinned_model, pinned_label, fetched):
        age(env, build["artifact_key"], days=100)
    age(env, fetched["artifact_key"], days=100, fetched_days_ago=2)
    age(env, retired["artifact_key"], days=3)
    for body in ({"kind": "artifact", "value": pinned_key["artifact_key"]},
                 {"kind": "model", "value": "keep-this-model"}, {"kind": "label", "value": "fleet:search"}):
        assert env.client.post("/v1/pins", json=body).status_code == 201
    kept = {b["artifact_key"]: files_of(env, b["artifact_key"])
            for b in (pinned_key, pinned_model, pinned_label, fetched, young)}
    doomed = {b["artifact_key"]: files_of(env, b["artifact_key"]) for b in (released, retired)}
    policy = retention.Policy.from_settings(env.settings, min_age_days=30, unfetched_days=30, retired="cpu:2.12.0",
                                            grace_seconds=0)

    dry = retention.run(env.services.sessions, env.services.store, policy, dry_run=True).to_json()
    assert {a["key"] for a in dry["artifacts"]} == set(doomed)
    assert all(whole(env, key, files) for key, files in {**kept, **doomed}.items())  # nothing was touched

    real = retention.run(env.services.sessions, env.services.store, policy, dry_run=False).to_json()
    for field in ("artifacts", "buckets", "documents", "blobs", "bytes_freed"):
        assert real[field] == dry[field], field
    # The bucket the in-flight set shares is kept with its files; the others of the doomed sets went.
    shared_bucket = next(b for b in env.client.get(f"/v1/builds/{shared_in_flight['build_id']}").json["buckets"]
                         if b["state"] == "succeeded")["key"]
    gone_buckets = {b for files in doomed.values() for b in files} - {shared_bucket}
    shared_files = doomed[released["artifact_key"]][shared_bucket]
    assert set(real["buckets"]) == gone_buckets
    assert real["blobs"] and real["documents"]
    still_named = {sha for files in kept.values() for shas in files.values() for sha in shas} | shared_files
    assert {b["sha256"] for b in real["blobs"]} == {  # the logs all read "compiling / done": one blob, kept
        sha for files in doomed.values() for bucket, shas in files.items() if bucket != shared_bucket
        for sha in shas} - still_named
    store = env.services.store
    assert all(store.has_blob(sha) for sha in shared_files)
    assert store.read_document(bucket_manifest_name(shared_bucket)) is not None
    assert all(whole(env, key, files) for key, files in kept.items())
    assert all(store.read_document(artifact_manifest_name(key)) is None for key in doomed)
    assert all(store.read_document(name(key)) is None for key in doomed  # the signed documents go with it
               for name in (artifact_signature_name, artifact_provenance_name))

    # What it did is on record, and the lookups say so.
    with env.services.sessions() as session:
        run_row = session.get_one(GcRun, real["run_id"])
        recorded = session.query(GcDeletion).filter(GcDeletion.run_id == real["run_id"]).count()
    assert run_row.artifacts == 2 and run_row.bytes_freed == real["bytes_freed"] and run_row.finished_at
    assert recorded == len(real["artifacts"]) + len(real["buckets"]) + len(real["documents"]) + len(real["blobs"])
    body = assert_problem(env.client.get(f"/v1/artifacts/{released['artifact_key']}"), 404, "artifact-not-published")
    assert body["state"] == "deleted" and "submit its spec again" in body["detail"]

    # A second run finds nothing more; a resubmit builds the deleted set again (the shared bucket reused).
    again = retention.run(env.services.sessions, env.services.store, policy, dry_run=False).to_json()
    assert again["artifacts"] == [] and again["documents"] == [] and again["blobs"] == []
    spec = env.client.get(f"/v1/builds/{released['build_id']}").json["spec"]
    rebuilt = env.submit(spec)
    assert rebuilt.status_code == 202 and rebuilt.json["outcome"] == "new", rebuilt.json
    states = {b["key"]: b["state"] for b in rebuilt.json["buckets"]}
    assert states[shared_bucket] == "succeeded" and set(states.values()) == {"succeeded", "queued"}
    complete_build(env.services, rebuilt.json["build_id"])
    assert env.client.get(f"/v1/artifacts/{released['artifact_key']}").status_code == 200


def test_within_the_grace_marks_are_made_and_files_kept(store_env: Env) -> None:
    env = store_env
    old = publish(env, b"old model")
    age(env, old["artifact_key"], days=100)
    files = files_of(env, old["artifact_key"])
    policy = retention.Policy.from_settings(env.settings, grace_seconds=3600)
    report = retention.run(env.services.sessions, env.services.store, policy, dry_run=False).to_json()
    assert [a["key"] for a in report["artifacts"]] == [old["artifact_key"]]
    assert report["documents"] == [] and report["blobs"] == []  # an API process may still hand them out
    assert whole(env, old["artifact_key"], files)


@pytest.mark.slow  # CLI subprocesses
def test_gc_command_exit_statuses(tmp_path: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env.update({"COMPILESVC_DATA_DIR": str(tmp_path / "data")})
    subprocess.run([sys.executable, "-m", "compilesvc", "migrate"], env=env, check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "compilesvc", "gc", "--dry-run", "--json"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dry_run"] is True
    bad = subprocess.run([sys.executable, "-m", "compilesvc", "gc", "--retired", "two"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "'two'" in bad.stderr
