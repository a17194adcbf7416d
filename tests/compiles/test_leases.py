"""Fenced leases, the reaper and the worker registry against real ledgers (Postgres and SQLite).

Compiles are created through the real :class:`~compilesvc.builds.submit.Submitter`; the broker is kombu's
filesystem transport in the test's own directory, so nothing leaves the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select, update

from compilesvc.builds.control import cancel_build, retry_build
from compilesvc.builds.submit import SubmitResult, Submitter
from compilesvc.compiles import failures, leases
from compilesvc.compiles.bucket_compiles import positioned_buckets
from compilesvc.compiles.publishing import build_artifact_manifest, publish_if_complete
from compilesvc.compiles.reaper import reap
from compilesvc.config.settings import Settings
from compilesvc.dispatch import registry
from compilesvc.ledger import events
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, BucketCompile, BucketFailure, Build, Event, Outbox, utcnow
from compilesvc.services import Services
from compilesvc.signing.artifacts import SLSA_PREDICATE, verify_artifact
from compilesvc.signing.keys import TrustedKeys
from compilesvc.spec.manifest import BucketManifest, FileEntry, parse_artifact_manifest
from compilesvc.spec.parsing import parse_spec
from compilesvc.states import IllegalTransition
from compilesvc.store import StoreError
from compilesvc.store.base import (
    artifact_manifest_name,
    artifact_provenance_name,
    artifact_signature_name,
    bucket_manifest_name,
)
from tests.doubles.compiler_flags import DOUBLE_AND_REJECTED_FLAGS
from tests.fixtures.settings import make_settings as fixture_settings

LEASE = 30.0


def make_settings(tmp_path: Path, database_url: str, **overrides: Any) -> Settings:
    """The shared test settings with two attempts per bucket (what the lease tests count against)."""
    return fixture_settings(tmp_path, database_url, **{"max_attempts": 2, **overrides})


@pytest.fixture
def services(tmp_path: Path, ledger_url: str):  # type: ignore[no-untyped-def]
    services = Services.from_settings(make_settings(tmp_path, ledger_url))
    yield services
    services.close()


@pytest.fixture
def pg_services(tmp_path: Path, pg_url: str):  # type: ignore[no-untyped-def]
    services = Services.from_settings(make_settings(tmp_path, pg_url))
    yield services
    services.close()


def submit(services: Services, buckets: int = 1, args: list[str] | None = None) -> SubmitResult:
    path = services.settings.data_dir / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a model")
    uri = f"blob:sha256:{services.store.put_file(path).sha256}"
    spec = parse_spec({
        "model": {"uri": uri, "format": "torchscript"}, "target": "inf2", "sdk": "2.20.0",
        "compiler": {"args": args or []},
        "buckets": [{"batch_size": 1, "seq_len": 8 * (i + 1)} for i in range(buckets)],
    }, extra_flags=DOUBLE_AND_REJECTED_FLAGS)
    return Submitter(services).submit(spec)


def bucket_id(services: Services, key: str) -> int:
    with services.sessions() as session:
        return int(session.scalars(select(BucketCompile.id).where(BucketCompile.key == key)).one())


def row(services: Services, bucket: int) -> BucketCompile:
    with services.sessions() as session:
        return session.get_one(BucketCompile, bucket)


def artifact_state(services: Services, key: str) -> str:
    with services.sessions() as session:
        return str(session.scalars(select(Artifact.state).where(Artifact.key == key)).one())


def claim(services: Services, bucket: int, worker: str = "w1") -> leases.Claim | None:
    with transaction(services.sessions) as session:
        return leases.claim(session, bucket, worker, LEASE)


def expire_now(services: Services, bucket: int) -> None:
    with transaction(services.sessions) as session:
        session.execute(update(BucketCompile).where(BucketCompile.id == bucket)
                        .values(lease_expires_at=utcnow() - timedelta(seconds=5)))


def unsent(services: Services) -> int:
    with services.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Outbox).where(Outbox.sent_at.is_(None))) or 0)


def publish_bucket_manifest(services: Services, c: leases.Claim) -> str:
    path = services.settings.data_dir / f"{c.key}.neff"
    path.write_bytes(b"compiled " + c.key.encode())
    blob = services.store.put_file(path)
    manifest = BucketManifest(key=c.key, material=c.material, inputs=c.inputs,
                              files=[FileEntry(path="model.pt", role="model", size=blob.size, sha256=blob.sha256)],
                              created_at=utcnow().isoformat())
    services.store.create_document(bucket_manifest_name(c.key), manifest.to_bytes())
    return services.store.document_location(bucket_manifest_name(c.key))


def test_claim_is_once_per_queueing(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    first = claim(services, bid)
    assert first is not None
    assert (first.attempt, first.token, first.key) == (1, 1, result.buckets[0].key)
    assert first.lease_expires_at > utcnow() + timedelta(seconds=LEASE - 10)
    assert claim(services, bid, "w2") is None  # a duplicate delivery finds nothing to claim
    assert claim(services, 999_999) is None
    bucket = row(services, bid)
    assert (bucket.state, bucket.worker_id, bucket.attempts) == ("running", "w1", 1)


def test_renew_reports_ownership_and_cancel(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    c = claim(services, bid)
    assert c is not None
    with transaction(services.sessions) as session:
        assert leases.renew(session, bid, c.token, LEASE) == leases.Renewal(True, False)
        assert leases.renew(session, bid, c.token + 1, LEASE) == leases.Renewal(False, False)
    cancel_build(services, result.build_id)
    with transaction(services.sessions) as session:
        assert leases.renew(session, bid, c.token, LEASE) == leases.Renewal(True, True)


def test_stale_worker_is_fenced_off(services: Services) -> None:
    """A worker whose lease was taken back cannot renew, succeed or fail; the new owner can."""
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    stale = claim(services, bid, "stale")
    assert stale is not None
    expire_now(services, bid)
    report = reap(services)
    assert report.requeued == [bid]
    assert row(services, bid).state == "queued"
    fresh = claim(services, bid, "fresh")
    assert fresh is not None and fresh.token > stale.token and fresh.attempt == 2

    uri = publish_bucket_manifest(services, fresh)
    with transaction(services.sessions) as session:
        assert not leases.renew(session, bid, stale.token, LEASE).still_ours
        assert leases.succeed(session, bid, stale.token, uri, {}, 1.0) is False
        assert leases.fail(session, bid, stale.token, "compile", "NCC_EVRF001", "late") is None
    assert row(services, bid).state == "running"  # the stale writes changed nothing
    with transaction(services.sessions) as session:
        assert leases.succeed(session, bid, fresh.token, uri, {"neuronx_cc": "2.15"}, 2.5) is True
        assert leases.succeed(session, bid, fresh.token, uri, {}, 2.5) is False  # once only
    bucket = row(services, bid)
    assert (bucket.state, bucket.worker_id, bucket.compile_seconds, bucket.manifest_uri) == (
        "succeeded", "fresh", 2.5, uri)
    with services.sessions() as session:
        transitions = session.execute(
            select(Event.from_state, Event.to_state).where(Event.entity == "bucket", Event.entity_id == bid)
            .order_by(Event.id)
        ).all()
    assert transitions == [(None, "queued"), ("queued", "running"), ("running", "queued"), ("queued", "running"),
                           ("running", "succeeded")]


def test_concurrent_claims_have_one_winner(pg_services: Services) -> None:
    result = submit(pg_services)
    bid = bucket_id(pg_services, result.buckets[0].key)
    barrier = threading.Barrier(8)
    won: list[leases.Claim] = []

    def contender(n: int) -> None:
        barrier.wait()
        c = claim(pg_services, bid, f"w{n}")
        if c is not None:
            won.append(c)

    threads = [threading.Thread(target=contender, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and row(pg_services, bid).attempts == 1


def test_compile_error_is_final_and_fails_the_set(services: Services) -> None:
    result = submit(services, buckets=2)
    bid = bucket_id(services, result.buckets[0].key)
    c = claim(services, bid)
    assert c is not None
    with transaction(services.sessions) as session:
        outcome = leases.fail(session, bid, c.token, "compile", "NCC_EOOM001", "over the HBM limit")
    assert outcome == leases.Outcome("failed", c.key)
    bucket = row(services, bid)
    assert (bucket.state, bucket.error_class, bucket.error_code, bucket.lease_expires_at) == (
        "failed", "compile", "NCC_EOOM001", None)
    assert artifact_state(services, result.artifact_key) == "failed"
    with services.sessions() as session:
        assert session.get_one(Build, result.build_id).state == "failed"
    assert claim(services, bid) is None


def test_infra_errors_requeue_until_the_attempt_cap(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    sent_before = unsent(services)
    first = claim(services, bid)
    assert first is not None
    with transaction(services.sessions) as session:
        outcome = leases.fail(session, bid, first.token, "timeout", "TIMEOUT", "time limit reached")
    assert outcome is not None and outcome.state == "queued" and outcome.outbox_id is not None
    assert unsent(services) == sent_before + 1
    with services.sessions() as session:
        outbox = session.get_one(Outbox, outcome.outbox_id)
        assert outbox.kwargs["bucket_compile_id"] == bid
    assert artifact_state(services, result.artifact_key) == "building"

    second = claim(services, bid)
    assert second is not None and second.attempt == 2  # max_attempts is 2
    with transaction(services.sessions) as session:
        outcome = leases.fail(session, bid, second.token, "infra", "SIGKILL", "killed")
    assert outcome == leases.Outcome("failed", second.key)
    bucket = row(services, bid)
    assert (bucket.state, bucket.error_class, bucket.attempts) == ("failed", "infra", 2)
    assert artifact_state(services, result.artifact_key) == "failed"
    # An infra failure is not a negative cache: submitting again requeues it with fresh attempts.
    again = submit(services)
    assert again.outcome == "new" and row(services, bid).state == "queued" and row(services, bid).attempts == 0


def test_an_interrupted_attempt_is_requeued_at_once_and_not_counted(services: Services) -> None:
    """A draining worker hands a compile back (issue 30): queued again with no backoff, the outbox row made
    in the same transaction, the attempt's number kept but not counted against max_attempts (2 here)."""
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    first = claim(services, bid)
    assert first is not None and (first.attempt, first.counted) == (1, 1)
    sent_before = unsent(services)
    with transaction(services.sessions) as session:
        outcome = leases.interrupt(session, bid, first.token, "worker w1 told to stop (SIGTERM)")
    assert outcome is not None and outcome.state == "queued" and outcome.outbox_id is not None
    assert outcome.retry_in == 0 and unsent(services) == sent_before + 1
    bucket = row(services, bid)
    assert (bucket.state, bucket.attempts, bucket.interruptions, bucket.worker_id) == ("queued", 1, 1, None)
    with services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(BucketFailure)
                              .where(BucketFailure.bucket_compile_id == bid)) == 0  # no failure of the build's
        reason = session.scalars(select(Event.detail).where(Event.entity == "bucket", Event.entity_id == bid,
                                                    Event.to_state == "queued")
                                 .order_by(Event.id.desc())).first()
    assert reason is not None and reason["reason"] == (
        "interrupted: worker w1 told to stop (SIGTERM); attempt 1 not counted")
    assert claim(services, bid, "w1") is not None  # the next delivery claims it: attempt 2
    with transaction(services.sessions) as session:
        assert leases.interrupt(session, bid, first.token, "again") is None

    # Two counted attempts remain: the first infra failure is retried, the second is final.
    second = row(services, bid)
    assert (second.state, second.attempts) == ("running", 2)
    with transaction(services.sessions) as session:
        retried = leases.fail(session, bid, second.lease_token, "infra", "SIGKILL", "killed")
    assert retried is not None and retried.state == "queued"
    third = claim(services, bid)
    assert third is not None and (third.attempt, third.counted, third.interruptions) == (3, 2, 1)
    with transaction(services.sessions) as session:
        final = leases.fail(session, bid, third.token, "infra", "SIGKILL", "killed again")
    assert final == leases.Outcome("failed", third.key)
    # A resubmit starts a new round: attempts and interruptions both start again.
    assert submit(services).outcome == "new"
    assert (row(services, bid).attempts, row(services, bid).interruptions) == (0, 0)


def test_past_the_free_interruptions_a_hand_back_counts(services: Services) -> None:
    """A compile that outlives every worker (a pool that keeps scaling in) does not loop for ever: after
    FREE_INTERRUPTIONS hand-backs, each counts against max_attempts (2 here) as an infrastructure failure."""
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    for _ in range(leases.FREE_INTERRUPTIONS):
        c = claim(services, bid)
        assert c is not None
        with transaction(services.sessions) as session:
            assert leases.interrupt(session, bid, c.token, "worker w1 told to stop").state == "queued"
    outcomes = []
    for _ in range(2):
        c = claim(services, bid)
        assert c is not None
        with transaction(services.sessions) as session:
            outcomes.append(leases.interrupt(session, bid, c.token, "worker w1 told to stop").state)
    assert outcomes == ["queued", "failed"]
    bucket = row(services, bid)
    assert (bucket.error_class, bucket.error_code, bucket.interruptions) == ("infra", "INTERRUPTED", 5)


def test_an_interrupted_attempt_whose_build_was_cancelled_is_cancelled(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    c = claim(services, bid)
    assert c is not None
    cancel_build(services, result.build_id)
    with transaction(services.sessions) as session:
        assert leases.interrupt(session, bid, c.token, "worker w1 told to stop") == leases.Outcome("cancelled", c.key)
    assert (row(services, bid).state, row(services, bid).interruptions) == ("cancelled", 0)


def _fail_attempt(services: Services, bid: int, error_class: str, code: str, message: str,
                  unknown_retries: int) -> leases.Outcome | None:
    c = claim(services, bid)
    assert c is not None
    with transaction(services.sessions) as session:
        return leases.fail(session, bid, c.token, error_class, code, message, unknown_retries=unknown_retries)


def test_unknown_failures_are_retried_a_bounded_number_of_times_then_reported(tmp_path: Path,
                                                                              ledger_url: str) -> None:
    """Identical unknown failures are retried (unlike infra ones): the setting, not the repeat rule, bounds
    them, within max_attempts; the final record says so, and nothing is negatively cached."""
    services = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=5))
    try:
        result = submit(services)
        bid = bucket_id(services, result.buckets[0].key)
        states = [getattr(_fail_attempt(services, bid, "unknown", "NEURONX_CC_EXIT_70", "exit 70, no code", 2),
                          "state", None) for _ in range(3)]
        assert states == ["queued", "queued", "failed"]
        bucket = row(services, bid)
        assert (bucket.state, bucket.error_class, bucket.error_code, bucket.attempts) == (
            "failed", "unknown", "NEURONX_CC_EXIT_70", 3)
        assert bucket.error_message.startswith("no diagnosis after 3 unknown failure(s) (2 retried; attempt 3 of 5)")
        with services.sessions() as session:
            history = failures.of_buckets(session, [bid])[bid]
        assert [(f.error_class, f.retry) for f in history] == [("unknown", True), ("unknown", True),
                                                                ("unknown", False)]
        assert artifact_state(services, result.artifact_key) == "failed"

        # A new submit is a fresh round with a fresh bound (older rounds' failures do not count against it).
        again = submit(services)
        assert again.buckets[0].state == "queued"
        kinds = [("infra", "SIGKILL"), ("unknown", "EXIT_1"), ("unknown", "EXIT_1"), ("unknown", "EXIT_1")]
        assert [_fail_attempt(services, bid, kind, code, "no code", 2).state  # type: ignore[union-attr]
                for kind, code in kinds] == ["queued", "queued", "queued", "failed"]
        assert row(services, bid).attempts == 4

        # The attempt cap still holds when it is lower than the unknown bound.
        capped = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=2))
        try:
            other = submit(capped, args=["-O1"])
            other_id = bucket_id(capped, other.buckets[0].key)
            assert [_fail_attempt(capped, other_id, "unknown", "EXIT_1", "no code", 5).state  # type: ignore[union-attr]
                    for _ in range(2)] == ["queued", "failed"]
        finally:
            capped.close()
    finally:
        services.close()


def test_unknown_failures_of_an_earlier_round_never_count_against_a_later_one(tmp_path: Path,
                                                                              ledger_url: str) -> None:
    """A round that gets further than the one before it (attempt 3 where the old round ended at 2) counts
    only its own unknown failures: the old round's attempt-1 unknown is not held against it."""
    services = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=5))
    try:
        result = submit(services)
        bid = bucket_id(services, result.buckets[0].key)
        first_round = [("unknown", "EXIT_1"), ("compile", "NCC_EVRF001")]
        assert [_fail_attempt(services, bid, kind, code, f"round 1 {kind}", 1).state  # type: ignore[union-attr]
                for kind, code in first_round] == ["queued", "failed"]
        assert submit(services).buckets[0].state == "failed"  # the compile error is cached ...
        retry_build(services, result.build_id)  # ... until an explicit retry starts round 2
        second_round = [("infra", "SIGKILL"), ("infra", "EIO"), ("unknown", "EXIT_1"), ("unknown", "EXIT_1")]
        assert [_fail_attempt(services, bid, kind, code, f"round 2 {code}", 1).state  # type: ignore[union-attr]
                for kind, code in second_round] == ["queued", "queued", "queued", "failed"]
        bucket = row(services, bid)
        assert bucket.error_message.startswith("no diagnosis after 2 unknown failure(s) (1 retried; attempt 4 of 5)")
        with services.sessions() as session:
            rounds = session.execute(select(BucketFailure.attempt_round, BucketFailure.attempt)
                                     .where(BucketFailure.bucket_compile_id == bid)
                                     .order_by(BucketFailure.id)).all()
        assert [tuple(r) for r in rounds] == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (1, 4)]
    finally:
        services.close()


def test_a_rejected_flag_is_final_and_negatively_cached(services: Services) -> None:
    result = submit(services, args=["--no-such-flag"])
    bid = bucket_id(services, result.buckets[0].key)
    outcome = _fail_attempt(services, bid, "bad_request", "COMPILER_FLAG_REJECTED",
                            "the compiler rejected --no-such-flag", 2)
    assert outcome is not None and outcome.state == "failed"
    assert artifact_state(services, result.artifact_key) == "failed"
    again = submit(services, args=["--no-such-flag"])
    assert (again.outcome, again.state, again.buckets[0].state) == ("join", "failed", "failed")
    assert row(services, bid).attempts == 1


def test_a_retry_waits_out_its_backoff_before_it_is_sent(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    services.relay.relay()
    first = claim(services, bid)
    assert first is not None
    with transaction(services.sessions) as session:
        outcome = leases.fail(session, bid, first.token, "infra", "PUBLISH_FAILED", "store down",
                              phase=failures.Phase.PUBLISH, backoff_seconds=3600)
    assert outcome is not None and outcome.state == "queued" and outcome.retry_in == 3600
    assert services.relay.relay() == 0  # held back by the backoff, though queued
    with transaction(services.sessions) as session:
        session.execute(update(Outbox).where(Outbox.id == outcome.outbox_id)
                        .values(available_at=utcnow() - timedelta(seconds=1)))
    assert services.relay.relay() == 1  # due now


def fail_twice(services: Services, bid: int, message: str) -> list[leases.Outcome | None]:
    """Two attempts of the compile, each failing for infrastructure with ``message``."""
    outcomes = []
    for _ in range(2):
        attempt = claim(services, bid)
        assert attempt is not None
        with transaction(services.sessions) as session:
            outcomes.append(leases.fail(session, bid, attempt.token, "infra", "EXIT_1", message))
    return outcomes


def test_a_failure_repeated_identically_is_not_retried_again(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=5))
    try:
        bid = bucket_id(services, submit(services).buckets[0].key)
        message = "RuntimeError: Storage size calculation overflowed with sizes=[1048576, 1048576]"
        outcomes = fail_twice(services, bid, message)
        assert [o.state for o in outcomes if o] == ["queued", "failed"]  # 2 of 5 attempts, not 5
        bucket = row(services, bid)
        assert (bucket.error_class, bucket.error_code, bucket.attempts) == ("infra", "EXIT_1", 2)
        assert "same failure as attempt 1" in (bucket.error_message or "")
    finally:
        services.close()


def test_a_long_failure_is_stored_head_and_tail_and_its_repetition_still_seen(tmp_path: Path,
                                                                             ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=5))
    try:
        bid = bucket_id(services, submit(services).buckets[0].key)
        # A traceback's worth of preamble, then the compiler's own error at the end.
        message = "Traceback: " + "frame " * 1500 + "RuntimeError: Storage size calculation overflowed"
        outcomes = fail_twice(services, bid, message)
        assert [o.state for o in outcomes if o] == ["queued", "failed"]  # compared as stored: a repetition
        with services.sessions() as session:
            history = failures.of_buckets(session, [bid])[bid]
        stored = [f.message for f in history]
        assert stored == [failures.shorten(message)] * 2
        assert len(stored[0] or "") == failures.MAX_MESSAGE == 4000
        assert (stored[0] or "").startswith("Traceback: frame frame")
        assert (stored[0] or "").endswith("frame RuntimeError: Storage size calculation overflowed")
        error_message = row(services, bid).error_message or ""
        assert len(error_message) == 4000 and error_message.startswith("the same failure as attempt 1")
        assert error_message.endswith("RuntimeError: Storage size calculation overflowed")
    finally:
        services.close()


def test_an_outage_that_reads_the_same_every_time_is_still_retried(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, max_attempts=3))
    try:
        bid = bucket_id(services, submit(services).buckets[0].key)
        states = []
        for _ in range(3):
            attempt = claim(services, bid)
            assert attempt is not None
            with transaction(services.sessions) as session:
                outcome = leases.fail(session, bid, attempt.token, "infra", "MODEL_FETCH_FAILED",
                                      "StoreUnavailable: S3 unavailable: Could not connect to the endpoint URL",
                                      phase=failures.Phase.FETCH)
            assert outcome is not None
            states.append(outcome.state)
        assert states == ["queued", "queued", "failed"]  # every attempt, not two
    finally:
        services.close()


def test_the_failure_history_keeps_every_attempt_first_cause_first(services: Services) -> None:
    bid = bucket_id(services, submit(services).buckets[0].key)
    steps = [("infra", "PUBLISH_FAILED", failures.Phase.PUBLISH), ("infra", "MODEL_FETCH_FAILED", failures.Phase.FETCH)]
    for error_class, code, phase in steps:
        attempt = claim(services, bid)
        assert attempt is not None
        with transaction(services.sessions) as session:
            leases.fail(session, bid, attempt.token, error_class, code, f"{code} on attempt {attempt.attempt}",
                        phase=phase)
    with services.sessions() as session:
        history = failures.of_buckets(session, [bid])[bid]
    assert [(f.attempt, f.phase, f.code, f.retry) for f in history] == [
        (1, "publish", "PUBLISH_FAILED", True), (2, "fetch", "MODEL_FETCH_FAILED", False)]
    assert row(services, bid).error_code == "MODEL_FETCH_FAILED"  # the last; the history has the first


def test_an_illegal_transition_is_refused(services: Services) -> None:
    bid = bucket_id(services, submit(services).buckets[0].key)
    with pytest.raises(IllegalTransition), transaction(services.sessions) as session:
        events.record(session, "bucket", bid, "succeeded", "running")


def test_cancel_then_cancelled_attempt(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    c = claim(services, bid)
    assert c is not None
    cancel_build(services, result.build_id)
    assert row(services, bid).cancel_requested
    with transaction(services.sessions) as session:
        assert leases.fail(session, bid, c.token, "cancelled", "CANCELLED", "cancelled") == leases.Outcome(
            "cancelled", c.key)
    bucket = row(services, bid)
    assert (bucket.state, bucket.error_class, bucket.cancel_requested) == ("cancelled", "cancelled", False)


def test_cancel_superseded_by_a_retry_requeues(services: Services) -> None:
    """The worker saw the cancel, but a retry reopened the build before it recorded it."""
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    c = claim(services, bid)
    assert c is not None
    cancel_build(services, result.build_id)
    retry_build(services, result.build_id)  # clears cancel_requested on the running compile
    with transaction(services.sessions) as session:
        outcome = leases.fail(session, bid, c.token, "cancelled", "CANCELLED", "cancelled")
    assert outcome is not None and outcome.state == "queued"
    assert artifact_state(services, result.artifact_key) == "building"


def test_reaper_fails_after_the_cap_and_cancels_when_asked(services: Services) -> None:
    result = submit(services, buckets=2)
    first, second = (bucket_id(services, b.key) for b in result.buckets)
    for attempt in (1, 2):
        assert claim(services, first) is not None
        expire_now(services, first)
        report = reap(services)
        assert report.requeued == ([first] if attempt == 1 else [])
        assert report.failed == ([first] if attempt == 2 else [])
    bucket = row(services, first)
    assert (bucket.state, bucket.error_class, bucket.error_code) == ("failed", "infra", "LEASE_EXPIRED")
    assert artifact_state(services, result.artifact_key) == "failed"

    other = submit(services, buckets=1, args=["--double-behaviour=slow:60"])
    bid = bucket_id(services, other.buckets[0].key)
    assert claim(services, bid) is not None
    cancel_build(services, other.build_id)
    expire_now(services, bid)
    assert reap(services).cancelled == [bid]
    assert row(services, bid).state == "cancelled"
    assert second  # untouched: still queued
    assert row(services, second).state == "queued"


def test_reaper_leaves_live_leases_alone(services: Services) -> None:
    result = submit(services)
    bid = bucket_id(services, result.buckets[0].key)
    assert claim(services, bid) is not None
    report = reap(services)
    assert not report.requeued and not report.failed and row(services, bid).state == "running"


def test_reaper_publishes_a_set_left_building(services: Services) -> None:
    """A worker recorded its compile and died before publishing the set: the reaper publishes it."""
    result = submit(services, buckets=2)
    complete_without_publishing(services, result)
    assert artifact_state(services, result.artifact_key) == "building"
    report = reap(services)
    assert report.published and artifact_state(services, result.artifact_key) == "published"
    assert services.store.read_document(artifact_manifest_name(result.artifact_key)) is not None
    assert reap(services).published == []  # idempotent
    assert_signed(services, result.artifact_key)  # the reaper signs what it publishes, as a worker does


def assert_signed(services: Services, key: str) -> None:
    """The published manifest's signature and provenance are in the store and verify under the service's key."""
    signer = services.signer
    assert signer is not None
    trusted = TrustedKeys({signer.key.key_id: signer.key.public_key})
    manifest = parse_artifact_manifest(services.store.read_document(artifact_manifest_name(key)) or b"", key)
    bundle = services.store.read_document(artifact_signature_name(key))
    assert bundle is not None and verify_artifact(trusted, bundle, manifest).key_id == signer.key.key_id
    provenance = trusted.verify(services.store.read_document(artifact_provenance_name(key)) or b"", what="p")
    assert provenance.statement["predicateType"] == SLSA_PREDICATE
    assert provenance.statement["predicate"]["runDetails"]["builder"]["builderDependencies"]  # the worker


def complete_without_publishing(services: Services, result: SubmitResult) -> int:
    """Every compile of the set recorded as succeeded, the set not published yet; returns the artifact's id."""
    for b in result.buckets:
        bid = bucket_id(services, b.key)
        c = claim(services, bid)
        assert c is not None
        uri = publish_bucket_manifest(services, c)
        with transaction(services.sessions) as session:
            assert leases.succeed(session, bid, c.token, uri, {}, 1.0)
    with services.sessions() as session:
        return int(session.scalars(select(Artifact.id).where(Artifact.key == result.artifact_key)).one())


def test_publish_if_complete_says_whether_this_call_published(services: Services) -> None:
    result = submit(services, buckets=2)
    artifact_id = complete_without_publishing(services, result)
    signer = services.signer
    assert publish_if_complete(services.store, services.sessions, artifact_id, signer=signer) is True
    assert publish_if_complete(services.store, services.sessions, artifact_id, signer=signer) is False  # another did
    assert artifact_state(services, result.artifact_key) == "published"
    assert_signed(services, result.artifact_key)


def test_a_deployment_that_publishes_unsigned_writes_no_signature(services: Services) -> None:
    result = submit(services, buckets=1)
    artifact_id = complete_without_publishing(services, result)
    assert publish_if_complete(services.store, services.sessions, artifact_id, signer=None) is True
    assert services.store.read_document(artifact_manifest_name(result.artifact_key)) is not None
    assert services.store.read_document(artifact_signature_name(result.artifact_key)) is None


def test_a_manifest_planted_in_the_store_is_neither_signed_nor_published(services: Services) -> None:
    """A manifest already under the set's name that names other files (written by something other than
    this set's publish) gets no signature: publishing it would put the service's name on it."""
    result = submit(services, buckets=1)
    artifact_id = complete_without_publishing(services, result)
    with services.sessions() as session:
        artifact = session.get_one(Artifact, artifact_id)
        built = build_artifact_manifest(services.store, artifact, positioned_buckets(session, artifact_id))
    planted = built.model_copy(deep=True)
    planted.buckets[0].files[0].sha256 = "ee" * 32
    assert services.store.create_document(artifact_manifest_name(result.artifact_key), planted.to_bytes())
    with pytest.raises(StoreError, match="not signed"):
        publish_if_complete(services.store, services.sessions, artifact_id, signer=services.signer)
    assert services.store.read_document(artifact_signature_name(result.artifact_key)) is None
    assert artifact_state(services, result.artifact_key) == "building"


def test_reaper_does_not_claim_a_set_a_worker_published_meanwhile(pg_services: Services) -> None:
    """Found by the soak (tests/soak): a worker records the set's last compile and publishes the set; the
    reaper's scan, a moment earlier, had found the set complete and unpublished; the reaper's publish then
    found it published and logged "artifact published by the reaper" (and reported it) all the same: a
    recovery that never happened, on 5% of the soak's sets. Here the worker's publish lands just after the
    scan."""
    services = pg_services
    result = submit(services, buckets=2)
    artifact_id = complete_without_publishing(services, result)
    scans: list[str] = []

    def after_scan(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not scans and statement.lstrip().startswith("SELECT artifacts.id") and "NOT (EXISTS" in statement:
            scans.append(statement)
            publish_if_complete(services.store, services.sessions, artifact_id,  # the worker, on another connection
                                signer=services.signer)

    event.listen(services.engine, "after_cursor_execute", after_scan)
    try:
        report = reap(services)
    finally:
        event.remove(services.engine, "after_cursor_execute", after_scan)
    assert scans, "the reaper's scan is not the statement this test waits for"
    assert report.published == []
    assert artifact_state(services, result.artifact_key) == "published"


def test_reaper_relays_unsent_rows(services: Services) -> None:
    submit(services, buckets=3)
    assert unsent(services) == 0  # the submit relayed its own rows
    with transaction(services.sessions) as session:
        session.execute(update(Outbox).values(sent_at=None))
    assert reap(services).relayed == 3 and unsent(services) == 0


def test_registry_lifecycle(services: Services) -> None:
    caps = {"targets": ["cpu"]}
    with transaction(services.sessions) as session:
        registry.register(session, "w1", "host-a", caps, ["compile.cpu.2.13.0"], 2)
        registry.register(session, "w2", "host-b", caps, ["compile.inf2.2.20.0"], 1)
    with transaction(services.sessions) as session:
        assert registry.live_queues(session, 60) == {"compile.cpu.2.13.0", "compile.inf2.2.20.0"}
        assert registry.heartbeat(session, "w1") and not registry.heartbeat(session, "nobody")
        registry.mark_stopped(session, "w2")
    with transaction(services.sessions) as session:
        assert [w.id for w in registry.live_workers(session, 60)] == ["w1"]
        assert not registry.heartbeat(session, "w2")  # stopped: must register again
        session.execute(update(registry.Worker).where(registry.Worker.id == "w1")
                        .values(heartbeat_at=utcnow() - timedelta(seconds=120)))
    with transaction(services.sessions) as session:
        assert registry.live_workers(session, 60) == []
        assert [w.id for w in registry.stale_workers(session, 60)] == ["w1"]
        registry.register(session, "w2", "host-b", caps, ["compile.inf2.2.20.0"], 4)  # a restart
    with services.sessions() as session:
        worker = session.get_one(registry.Worker, "w2")
        assert (worker.slots, worker.stopped_at) == (4, None)
    with transaction(services.sessions) as session:
        registry.mark_draining(session, "w2")
    with transaction(services.sessions) as session:
        draining = session.get_one(registry.Worker, "w2")
        assert draining.draining_at is not None
        assert [w.id for w in registry.live_workers(session, 60)] == ["w2"]  # draining still heartbeats
        assert registry.live_queues(session, 60) == set()  # but takes no new work: no capacity for a submit
        registry.register(session, "w2", "host-b", caps, ["compile.inf2.2.20.0"], 4)  # a new life
    with services.sessions() as session:
        assert session.get_one(registry.Worker, "w2").draining_at is None


@pytest.mark.slow
def test_relay_command_runs_one_pass(tmp_path: Path, pg_services: Services) -> None:
    """`compilesvc relay --once` in its own process: requeues an expired lease and relays the message."""
    result = submit(pg_services)
    bid = bucket_id(pg_services, result.buckets[0].key)
    assert claim(pg_services, bid) is not None
    expire_now(pg_services, bid)
    settings = pg_services.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env.update({"COMPILESVC_DATA_DIR": str(settings.data_dir), "COMPILESVC_DATABASE_URL": settings.database_url or "",
                "COMPILESVC_STORE_URL": settings.resolved_store_url, "COMPILESVC_BROKER_URL": "filesystem://",
                "COMPILESVC_SECRET_KEY": "k"})
    proc = subprocess.run([str(Path(sys.executable).with_name("compilesvc")), "relay", "--once"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert any(r["msg"] == "reaper pass" and r["requeued"] == [bid] and r["relayed"] == 1 for r in records)
    assert row(pg_services, bid).state == "queued" and unsent(pg_services) == 0


def test_a_heartbeat_reads_whether_the_worker_was_told_to_stop(services: Services) -> None:
    """The worker's heartbeat thread learns from its own beat that another process set ``draining_at``
    (workers/liveness.py stops the worker then)."""
    with transaction(services.sessions) as session:
        registry.register(session, "w9", "host", {}, ["compile.cpu.x"], 1)
    with transaction(services.sessions) as session:
        assert registry.heartbeat(session, "w9") == registry.Beat(draining=False)
        registry.mark_draining(session, "w9")
    with transaction(services.sessions) as session:
        assert registry.heartbeat(session, "w9") == registry.Beat(draining=True)
        assert "compile.cpu.x" not in registry.live_queues(session, 60)  # admission counts it out
