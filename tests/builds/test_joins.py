"""Identical submits in flight together (compilesvc.builds.joins): one runs, the others wait for it and join its set
in one transaction, on both ledgers; whatever the first one meets otherwise, each of the others runs alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from compilesvc.builds.control import cancel_build
from compilesvc.builds.joins import join_batch
from compilesvc.builds.submit import SubmitResult, Submitter
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.ledger.models import Artifact, BucketCompile, Build, BuildLabel, Event, Outbox
from compilesvc.refusals import NoCapableWorker
from compilesvc.services import Services
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.settings import make_settings
from tests.fixtures.submits import complete_bucket, count, principal, spec_doc, upload_model
from tests.fixtures.waiting import wait_for

FOLLOWERS = 6



@dataclass(frozen=True)
class Hold:
    release: threading.Event
    entered: threading.Event  # the leader is at its first statement: it leads


@contextmanager
def leader_held(services: Services) -> Iterator[Hold]:
    """The thread named "leader" stops at its first statement until ``release`` is set."""
    held = Hold(release=threading.Event(), entered=threading.Event())
    release, entered = held.release, held.entered

    def stop_leader(*_args: Any) -> None:
        if threading.current_thread().name == "leader" and not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never released the leader"

    event.listen(services.engine, "before_cursor_execute", stop_leader)
    try:
        yield held
        assert entered.is_set(), "the leader ran no statement"
    finally:
        release.set()
        event.remove(services.engine, "before_cursor_execute", stop_leader)


def statements(services: Services, fragment: str) -> list[str]:
    """The statements containing ``fragment`` that run from now on (appended as they run)."""
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if fragment in statement:
            seen.append(statement)

    event.listen(services.engine, "after_cursor_execute", note)
    return seen


def submit_together(submitter: Submitter, specs: list[CompileSpec], hold: Hold,
                    **kwargs: Any) -> list[SubmitResult | BaseException]:
    """The first spec submitted by "leader" (held at its first statement), then the rest once all of them
    wait for it; the answers (or errors) in order."""
    answers: list[SubmitResult | BaseException] = [RuntimeError("no answer")] * len(specs)

    def run(index: int) -> None:
        try:
            answers[index] = submitter.submit(specs[index], **kwargs)
        except BaseException as exc:
            answers[index] = exc

    threads = [threading.Thread(target=run, args=(i,), name="leader" if i == 0 else f"follower-{i}")
               for i in range(len(specs))]
    threads[0].start()
    assert hold.entered.wait(30), "the leader never ran a statement"  # the others must find it leading
    key = submitter.prepare(specs[0]).keys.key
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: submitter.in_flight.waiting(key) == len(specs) - 1, 30, "the followers to queue up")
    hold.release.set()
    for thread in threads:
        thread.join(60)
    return answers


def results(answers: list[SubmitResult | BaseException]) -> list[SubmitResult]:
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return [a for a in answers if isinstance(a, SubmitResult)]


def test_identical_submits_wait_for_the_first_and_join_in_one_insert(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    specs = [parse_spec(spec_doc(uri, labels={"job": str(i)})) for i in range(FOLLOWERS + 1)]
    inserts = statements(services, "INSERT INTO builds")
    with leader_held(services) as hold:
        answers = results(submit_together(submitter, specs, hold, queue_anyway=True))

    assert [a.outcome for a in answers] == ["new"] + ["join"] * FOLLOWERS
    assert len({a.build_id for a in answers}) == FOLLOWERS + 1
    assert len(inserts) == 2  # the leader's build, then every follower's in one statement
    leader, followers = answers[0], answers[1:]
    for follower in followers:  # each answered as a lone join is: the set, its buckets, current
        assert (follower.state, follower.artifact_key, follower.artifact_state) == (
            "building", leader.artifact_key, "building")
        assert [(b.key, b.state) for b in follower.buckets] == [(b.key, "queued") for b in leader.buckets]
    assert count(services, Artifact) == 1 and count(services, BucketCompile) == 3 and count(services, Outbox) == 3
    with services.sessions() as session:  # committed: rows, labels, provenance and a creation event each
        builds = {b.id: b for b in session.scalars(select(Build))}
        for index, answer in enumerate(answers):
            build = builds[answer.build_id]
            assert (build.outcome, build.state, build.labels) == (answer.outcome, "building", {"job": str(index)})
        # As a lone join records it: each bucket joined the compile the first submit queued.
        assert [{entry["how"] for entry in builds[a.build_id].provenance.values()} for a in followers] == [
            {"joined"}] * FOLLOWERS
        assert {entry["from_build"] for a in followers for entry in builds[a.build_id].provenance.values()} == {
            leader.build_id}
        assert len(session.scalars(select(BuildLabel.build_id).where(BuildLabel.name == "job")).all()) == FOLLOWERS + 1
        created = session.scalars(select(Event.entity_id).where(Event.entity == "build")).all()
        assert sorted(created) == sorted(builds)


def test_followers_of_a_refused_submit_are_each_refused(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, require_live_worker=True))
    try:
        submitter = Submitter(services)
        uri = upload_model(services)
        specs = [parse_spec(spec_doc(uri))] * 4
        with leader_held(services) as hold:
            answers = submit_together(submitter, specs, hold)
        assert all(isinstance(a, NoCapableWorker) for a in answers), answers
        assert count(services, Build) == 0 and count(services, Artifact) == 0
    finally:
        services.close()


def test_followers_of_a_hit_answer_hits(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = Submitter(services).submit(spec)  # another process's submitter: this one has seen nothing
    for bucket in first.buckets:
        complete_bucket(services, bucket.key)
    with leader_held(services) as hold:
        answers = results(submit_together(submitter, [spec] * 4, hold))
    assert [a.outcome for a in answers] == ["hit"] * 4
    assert all(a.manifest is not None for a in answers)


def context_of(submitter: Submitter, spec: CompileSpec) -> SubmitContext:
    prepared = submitter.prepare(spec)
    return SubmitContext(spec, prepared.pinned, prepared.keys, None, None, prepared.request_hash)


@pytest.mark.parametrize("ended", ["cancelled", "published", "every bucket done"])
def test_a_set_no_longer_simply_in_flight_sends_each_submit_alone(services: Services, ended: str) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    if ended == "cancelled":
        cancel_build(services, first.build_id)
    else:
        for bucket in first.buckets:
            complete_bucket(services, bucket.key)
        if ended == "every bucket done":  # as a worker that died between its commit and the publish leaves it
            with services.sessions.begin() as session:
                session.scalars(select(Artifact).where(Artifact.key == first.artifact_key)).one().state = "building"
    builds = count(services, Build)
    assert join_batch(services.sessions, [context_of(submitter, spec)] * 3) is None
    assert count(services, Build) == builds  # nothing written


def test_a_batch_of_joins_records_each_submitter(services: Services) -> None:
    submitter = Submitter(services)
    spec = parse_spec(spec_doc(upload_model(services)))
    first = submitter.submit(spec)
    prepared = submitter.prepare(spec)
    contexts = [SubmitContext(spec, prepared.pinned, prepared.keys, principal(services, owner), None, "h")
                for owner in ("ci-a", "ci-b")]
    joined = join_batch(services.sessions, contexts)
    assert joined is not None and (joined.state, joined.artifact_state) == ("building", "building")
    assert [b.key for b in joined.buckets] == [b.key for b in first.buckets]
    with services.sessions() as session:
        rows = [session.get_one(Build, build_id) for build_id in joined.build_ids]
        assert [(r.submitted_by, r.outcome, r.artifact_key) for r in rows] == [
            ("ci-a", "join", first.artifact_key), ("ci-b", "join", first.artifact_key)]

