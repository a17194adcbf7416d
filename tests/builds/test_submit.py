"""Submit-time dedupe: hits, joins, new builds, bucket reuse, negative cache, store import, idempotency,
and exactly-once under concurrent submitters in separate processes (real Postgres and SQLite)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select, update

from compilesvc.access import idempotency
from compilesvc.builds.control import cancel_build, retry_build
from compilesvc.builds.submit import Submitter
from compilesvc.config.settings import Settings
from compilesvc.dispatch.registry import live_queues
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, BucketCompile, Build, Event, IdempotencyKey, Outbox, utcnow
from compilesvc.refusals import IdempotencyConflict, NoCapableWorker
from compilesvc.services import Services
from compilesvc.spec.manifest import ManifestMismatch
from compilesvc.spec.parsing import parse_spec
from compilesvc.store.base import bucket_manifest_name
from tests.fixtures.settings import make_settings
from tests.fixtures.submits import BUCKETS, complete_bucket, count, principal, spec_doc, upload_model


def test_new_join_then_hit(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services), labels={"team": "search"}))
    first = submitter.submit(spec, principal=principal(services, owner="ci"))
    assert (first.outcome, first.state, first.artifact_state) == ("new", "building", "building")
    assert [b.state for b in first.buckets] == ["queued"] * 3
    assert count(services, Outbox) == 3

    second = submitter.submit(spec)
    assert (second.outcome, second.artifact_key) == ("join", first.artifact_key)
    assert count(services, BucketCompile) == 3 and count(services, Outbox) == 3

    for bucket in first.buckets:
        complete_bucket(services, bucket.key)
    third = submitter.submit(spec)
    assert (third.outcome, third.state) == ("hit", "succeeded")
    assert third.manifest is not None and len(third.manifest.buckets) == 3
    with services.sessions() as session:
        states = session.scalars(select(Build.state).order_by(Build.id)).all()
    assert states == ["succeeded"] * 3  # the joined builds followed their artifact


def test_adding_a_bucket_compiles_only_that_bucket(services: Services) -> None:
    submitter = Submitter(services)
    model = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(model, BUCKETS[:2])))
    for bucket in first.buckets:
        complete_bucket(services, bucket.key)
    grown = submitter.submit(parse_spec(spec_doc(model, BUCKETS)))
    assert grown.outcome == "new" and grown.artifact_key != first.artifact_key
    assert sorted(b.state for b in grown.buckets) == ["queued", "succeeded", "succeeded"]
    assert count(services, BucketCompile) == 3 and count(services, Outbox) == 3


def test_reordered_buckets_and_labels_are_the_same_artifact(services: Services) -> None:
    submitter = Submitter(services)
    model = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(model, BUCKETS, labels={"a": "1"})))
    again = submitter.submit(parse_spec(spec_doc(model, list(reversed(BUCKETS)), labels={"b": "2"})))
    assert again.outcome == "join" and again.artifact_key == first.artifact_key


def test_compile_error_is_negatively_cached_until_retry(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    complete_bucket(services, first.buckets[0].key, state="failed", error_class="compile",
                    error_code="CPU_TRACE_ERROR")
    again = submitter.submit(spec)
    assert (again.outcome, again.state, again.artifact_state) == ("join", "failed", "failed")
    assert count(services, Outbox) == 3  # nothing re-dispatched

    # A different set containing the failed bucket fails at once, and queues nothing for it.
    other = submitter.submit(parse_spec(spec_doc(spec.model.uri, [BUCKETS[0]])))
    assert other.state == "failed" and count(services, Outbox) == 3

    outbox_ids = retry_build(services, again.build_id)
    assert len(outbox_ids) == 1
    with services.sessions() as session:
        bucket = session.scalars(select(BucketCompile).where(BucketCompile.key == first.buckets[0].key)).one()
        build = session.get_one(Build, again.build_id)
    assert (bucket.state, bucket.error_class, bucket.attempts) == ("queued", None, 0)
    assert build.state == "building"


def test_infrastructure_failure_never_sticks(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    attempts = services.settings.max_attempts
    for _ in range(attempts):  # each failure before the cap is requeued by the lease code itself
        complete_bucket(services, first.buckets[1].key, state="failed", error_class="infra")
    with services.sessions() as session:
        assert session.scalars(select(Artifact.state)).one() == "failed"
    again = submitter.submit(spec)
    assert again.state == "building"
    by_key = {b.key: b.state for b in again.buckets}
    assert by_key[first.buckets[1].key] == "queued"
    assert count(services, Outbox) == 3 + (attempts - 1) + 1


def test_cancel_then_resubmit_requeues(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    cancel_build(services, first.build_id)
    with services.sessions() as session:
        assert set(session.scalars(select(BucketCompile.state))) == {"cancelled"}
        assert session.get_one(Build, first.build_id).state == "cancelled"
    again = submitter.submit(spec)
    assert again.state == "building" and {b.state for b in again.buckets} == {"queued"}
    with services.sessions() as session:
        assert session.get_one(Build, first.build_id).state == "cancelled"  # the old build stays cancelled


def test_cancel_keeps_buckets_other_builds_need(services: Services) -> None:
    submitter = Submitter(services)
    model = upload_model(services)
    small = submitter.submit(parse_spec(spec_doc(model, BUCKETS[:1])))
    submitter.submit(parse_spec(spec_doc(model, BUCKETS)))
    cancel_build(services, small.build_id)
    with services.sessions() as session:
        assert set(session.scalars(select(BucketCompile.state))) == {"queued"}


def test_manifest_in_store_is_imported_into_an_empty_ledger(tmp_path: Path, services: Services,
                                                            pg_database: str) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    for bucket in first.buckets:
        complete_bucket(services, bucket.key)

    # A second ledger (a rebuilt database, another region) sharing the same store.
    other_url = f"sqlite:///{tmp_path / 'other.db'}"
    from compilesvc.ledger.migrate import upgrade

    upgrade(other_url)
    other = Services.from_settings(make_settings(tmp_path, other_url))
    try:
        result = Submitter(other).submit(spec)
        assert (result.outcome, result.state, result.artifact_key) == ("hit", "succeeded", first.artifact_key)
        assert count(other, BucketCompile) == 3 and count(other, Outbox) == 0
        with other.sessions() as session:
            assert session.scalars(select(Artifact.state)).one() == "published"
    finally:
        other.close()


def test_bucket_manifest_in_store_is_reused(tmp_path: Path, services: Services) -> None:
    submitter = Submitter(services)
    model = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(model, BUCKETS[:1])))
    complete_bucket(services, first.buckets[0].key)

    other_url = f"sqlite:///{tmp_path / 'other.db'}"
    from compilesvc.ledger.migrate import upgrade

    upgrade(other_url)
    other = Services.from_settings(make_settings(tmp_path, other_url))
    try:
        result = Submitter(other).submit(parse_spec(spec_doc(model, BUCKETS[:2])))
        assert sorted(b.state for b in result.buckets) == ["queued", "succeeded"]
        assert count(other, Outbox) == 1
    finally:
        other.close()


def test_bucket_manifest_under_another_key_is_refused(services: Services) -> None:
    submitter = Submitter(services)
    model = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(model, BUCKETS[:1])))
    complete_bucket(services, first.buckets[0].key)
    other = submitter.keys_for(parse_spec(spec_doc(model, BUCKETS[1:2])))[1].bucket_keys[0]
    genuine = services.store.read_document(bucket_manifest_name(first.buckets[0].key))
    assert genuine is not None and services.store.create_document(bucket_manifest_name(other), genuine)
    builds = count(services, Build)
    with pytest.raises(ManifestMismatch, match=other):
        submitter.submit(parse_spec(spec_doc(model, BUCKETS[:2])))
    assert count(services, Build) == builds


def test_idempotency_key(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    ci, other = principal(services, owner="ci"), principal(services, owner="other")
    first = submitter.submit(spec, principal=ci, idempotency_key="ci-run-42")
    again = submitter.submit(spec, principal=ci, idempotency_key="ci-run-42")
    assert again.replayed and again.build_id == first.build_id and again.first_status == 202
    assert count(services, Build) == 1
    changed = parse_spec(spec_doc(spec.model.uri, BUCKETS[:1]))
    with pytest.raises(IdempotencyConflict):
        submitter.submit(changed, principal=ci, idempotency_key="ci-run-42")
    # Keys are per token: another token's same key is its own request.
    theirs = submitter.submit(changed, principal=other, idempotency_key="ci-run-42")
    assert not theirs.replayed and theirs.build_id != first.build_id
    with pytest.raises(ValueError, match="belongs to a token"):
        submitter.submit(spec, idempotency_key="no-token")


def test_idempotency_keys_expire(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, idempotency_key_seconds=60))
    try:
        submitter, ci = Submitter(services), principal(services, owner="ci")
        spec = parse_spec(spec_doc(upload_model(services)))
        first = submitter.submit(spec, principal=ci, idempotency_key="nightly")
        with transaction(services.sessions) as session:  # a day later, as the ledger sees it
            session.execute(update(IdempotencyKey).values(created_at=utcnow() - timedelta(seconds=61)))
        changed = parse_spec(spec_doc(spec.model.uri, BUCKETS[:1]))
        later = submitter.submit(changed, principal=ci, idempotency_key="nightly")  # no conflict: a new key
        assert not later.replayed and later.build_id != first.build_id
        assert submitter.submit(changed, principal=ci, idempotency_key="nightly").build_id == later.build_id
        with transaction(services.sessions) as session:  # the relay's sweep removes what expired, only that
            session.execute(update(IdempotencyKey).where(IdempotencyKey.build_id == later.build_id)
                            .values(created_at=utcnow() - timedelta(seconds=30)))
            assert idempotency.delete_expired(session, 60) == 0
            assert idempotency.delete_expired(session, 10) == 1
    finally:
        services.close()


def test_refuses_work_no_live_worker_can_serve(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, require_live_worker=True))
    try:
        submitter = Submitter(services)
        spec = parse_spec(spec_doc(upload_model(services)))
        with pytest.raises(NoCapableWorker, match=r"compile\.cpu\.2\.13\.0"):
            submitter.submit(spec)
        assert count(services, Build) == 0
        assert submitter.submit(spec, queue_anyway=True).outcome == "new"

        from compilesvc.ledger.models import Worker

        with services.sessions.begin() as session:
            session.add(Worker(id="w1", hostname="h", capabilities={}, queues=["compile.cpu.2.13.0"], slots=2))
        with services.sessions() as session:
            assert "compile.cpu.2.13.0" in live_queues(session, 60)
        other = parse_spec(spec_doc(spec.model.uri, BUCKETS[:1]))
        assert submitter.submit(other).outcome == "new"
    finally:
        services.close()


def test_negative_cache_answers_without_a_live_worker(tmp_path: Path, ledger_url: str) -> None:
    """A compile error is the answer for its key: no worker is needed to give it again."""
    services = Services.from_settings(make_settings(tmp_path, ledger_url, require_live_worker=True))
    try:
        submitter = Submitter(services)
        spec = parse_spec(spec_doc(upload_model(services), BUCKETS[:1]))
        first = submitter.submit(spec, queue_anyway=True)
        complete_bucket(services, first.buckets[0].key, state="failed", error_class="compile", error_code="E")
        again = submitter.submit(spec)
        assert (again.outcome, again.state) == ("join", "failed")
        assert again.buckets[0].error_class == "compile"
    finally:
        services.close()


# -- concurrency: separate processes, real Postgres ------------------------------------------------

def _submit_many(settings_json: str, spec_json: str, n: int, queue: multiprocessing.Queue,  # type: ignore[type-arg]
                 start: Any) -> None:
    settings = Settings.model_validate_json(settings_json)
    services = Services.from_settings(settings)
    submitter = Submitter(services)
    spec = parse_spec(json.loads(spec_json))
    outcomes = []
    try:
        with services.sessions() as session:  # connected and warm before the race starts
            session.scalar(select(func.count()).select_from(Build))
        start.wait(timeout=120)  # every process submits its first request at the same moment
        for _ in range(n):
            outcomes.append(submitter.submit(spec).outcome)
    except Exception as exc:  # reported to the parent, which fails the test
        queue.put(("error", repr(exc)))
        return
    finally:
        services.close()
    queue.put(("ok", outcomes))


@pytest.mark.slow
def test_concurrent_identical_submits_create_one_build_row_set(tmp_path: Path, pg_url: str) -> None:
    settings = make_settings(tmp_path, pg_url)
    services = Services.from_settings(settings)
    model = upload_model(services, hashlib.sha256(b"concurrency").digest())
    spec_json = json.dumps(spec_doc(model))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = ctx.Barrier(8)
    procs = [ctx.Process(target=_submit_many, args=(settings.model_dump_json(), spec_json, 50, queue, start))
             for _ in range(8)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=240) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert [proc.exitcode for proc in procs] == [0] * 8
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    outcomes = [o for _, batch in results for o in batch]
    assert len(outcomes) == 400
    assert outcomes.count("new") == 1 and outcomes.count("join") == 399
    assert count(services, Artifact) == 1
    assert count(services, BucketCompile) == 3
    assert count(services, Outbox) == 3
    assert count(services, Build) == 400
    with services.sessions() as session:  # the artifact started building exactly once
        assert session.scalar(select(func.count()).select_from(Event).where(
            Event.entity == "artifact", Event.to_state == "building")) == 1
    sent = list((settings.broker_folder / "queue").iterdir())
    assert len(sent) == 3  # exactly one dispatch per bucket reached the broker
    services.close()


@pytest.mark.slow
def test_joins_racing_the_last_compile_leave_no_build_behind(tmp_path: Path, pg_url: str) -> None:
    # Joins share the set's lock (a burst of identical submits joins in parallel); the worker that publishes
    # the set takes it exclusively. Whatever the interleaving, no join may be left building once the set
    # is published: each either joined before the publish (and was moved on with the set) or found it
    # published (a hit).
    services = Services.from_settings(make_settings(tmp_path, pg_url))
    joiners = Services.from_settings(make_settings(tmp_path, pg_url))
    submitter = Submitter(joiners)

    # Widen the race: each join dawdles between reading the set's compiles and adding its build, the window
    # in which an unlocked join would miss the publish (and, having seen a compile unfinished, not publish
    # the set itself afterwards).
    def dawdle(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "JOIN artifact_buckets" in statement:
            time.sleep(0.02)

    event.listen(joiners.engine, "after_cursor_execute", dawdle)
    spec = parse_spec(spec_doc(upload_model(services, b"race")))
    first = submitter.submit(spec, queue_anyway=True)
    keys = [bucket.key for bucket in first.buckets]
    for key in keys[:-1]:
        complete_bucket(services, key)
    start = threading.Barrier(7)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def join_repeatedly() -> None:
        start.wait()
        try:
            for _ in range(25):
                outcomes.append(submitter.submit(spec, queue_anyway=True).outcome)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join_repeatedly) for _ in range(6)]
    for thread in threads:
        thread.start()
    start.wait()
    complete_bucket(services, keys[-1])  # publishes the set while the joins run
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert len(outcomes) == 150 and set(outcomes) <= {"join", "hit"}
    with services.sessions() as session:
        states = session.execute(select(Build.state, func.count()).group_by(Build.state)).all()
    assert dict(states) == {"succeeded": 151}
    joiners.close()
    services.close()


def test_resubmitting_a_cancelled_set_whose_shared_bucket_failed_since_answers_the_failure(
        services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    shared, own, other = BUCKETS
    cancelled = submitter.submit(parse_spec(spec_doc(uri, [shared, own])))
    cancel_build(services, cancelled.build_id)
    elsewhere = submitter.submit(parse_spec(spec_doc(uri, [shared, other])))
    shared_key = next(b.key for b in elsewhere.buckets if b.inputs == cancelled.buckets[0].inputs)
    complete_bucket(services, shared_key, state="failed", error_class="compile", error_code="NCC_EVRF007")
    again = submitter.submit(parse_spec(spec_doc(uri, [shared, own])))
    # Not "cancelled" (the earlier build's fate): the compile error that makes this set fail.
    assert (again.outcome, again.state, again.artifact_state) == ("join", "failed", "failed")
    assert next(b for b in again.buckets if b.key == shared_key).error_code == "NCC_EVRF007"
    with services.sessions() as session:
        assert session.get_one(Build, cancelled.build_id).state == "cancelled"  # the old build keeps its fate
