"""Group commit of build records (real Postgres and SQLite): concurrent submits share one transaction,
each caller gets its own id only once committed, and one bad record fails alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import event, select

from compilesvc.builds.submit import Submitter
from compilesvc.ledger.build_records import BuildRecord, BuildRecorder
from compilesvc.ledger.models import Artifact, BuildLabel, Event
from compilesvc.services import Services
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.submits import complete_bucket, spec_doc, upload_model
from tests.fixtures.waiting import wait_for

RECORDS = 16



def published_artifact(services: Services) -> int:
    """A published artifact's id (builds reference one), made through the real submit and finish paths."""
    result = Submitter(services).submit(parse_spec(spec_doc(upload_model(services))))
    for bucket in result.buckets:
        complete_bucket(services, bucket.key)
    with services.sessions() as session:
        return session.scalars(select(Artifact.id).where(Artifact.key == result.artifact_key)).one()


def record(artifact_id: int, n: int) -> BuildRecord:
    return BuildRecord(row={"artifact_id": artifact_id, "artifact_key": "k" * 64, "state": "succeeded",
                            "outcome": "hit", "labels": {"n": str(n)}, "spec": {}, "target": "cpu",
                            "sdk": "2.13.0", "backend": "torchscript", "model_sha256": "0" * 64,
                            "request_hash": "0" * 64},
                       labels={"n": str(n)}, detail={"outcome": "hit"})


def gated_writer(services: Services) -> tuple[threading.Event, threading.Event, list[int]]:
    """Hold the recorder's first write until the returned gate opens (``held`` is set once it waits there);
    count the batches written (each inserts its creation events in one statement, on either ledger, in its
    one transaction). Everything recorded meanwhile queues up and must go into one later batch."""
    gate, held, batches = threading.Event(), threading.Event(), [0]

    def first_waits(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "INSERT INTO events" not in statement:
            return
        if batches[0] == 0:
            held.set()
            gate.wait(30)
        batches[0] += 1

    event.listen(services.engine, "before_cursor_execute", first_waits)
    return gate, held, batches


def queued(recorder: BuildRecorder, count: int) -> None:
    """Wait until ``count`` records wait in the recorder's line behind the held transaction's."""
    wait_for(lambda: recorder.waiting == count + 1, 30, f"{count} queued records")


def test_concurrent_records_share_a_transaction(services: Services) -> None:
    artifact_id = published_artifact(services)
    recorder = BuildRecorder(services.engine)
    gate, held, commits = gated_writer(services)
    with ThreadPoolExecutor(RECORDS) as pool:
        first = pool.submit(recorder.record, record(artifact_id, 0))
        assert held.wait(30)  # the writer now holds record 0 at the gate
        rest = [pool.submit(recorder.record, record(artifact_id, n)) for n in range(1, RECORDS)]
        queued(recorder, RECORDS - 1)  # ... and the others queue behind it
        assert not first.done() and not any(f.done() for f in rest), "answered before its commit"
        gate.set()
        ids = [first.result(30), *(f.result(30) for f in rest)]
    assert len(set(ids)) == RECORDS
    assert commits[0] == 2  # record 0 alone, then the fifteen that queued meanwhile, together
    with services.sessions() as session:
        rows = session.execute(select(BuildLabel.build_id, BuildLabel.value).where(BuildLabel.build_id.in_(ids)))
        labels = {build_id: value for build_id, value in rows}
        created = session.scalars(select(Event.entity_id).where(Event.entity == "build",
                                                                Event.entity_id.in_(ids))).all()
    assert labels == {build_id: str(n) for n, build_id in enumerate(ids)}  # each id got its own record
    assert sorted(created) == sorted(ids)


def test_a_bad_record_fails_alone(services: Services) -> None:
    artifact_id = published_artifact(services)
    recorder = BuildRecorder(services.engine)
    gate, held, _ = gated_writer(services)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(recorder.record, record(artifact_id, 0))
        assert held.wait(30)
        good = [pool.submit(recorder.record, record(artifact_id, n)) for n in (1, 2)]
        bad = pool.submit(recorder.record, record(artifact_id + 10_000, 3))  # no such artifact: FK refuses
        queued(recorder, 3)
        gate.set()
        assert first.result(30) and all(f.result(30) for f in good)
        with pytest.raises(Exception, match=r"(?i)foreign key"):
            bad.result(30)


def test_an_unexpected_failure_answers_its_callers_and_the_writer_goes_on(services: Services) -> None:
    artifact_id = published_artifact(services)
    recorder = BuildRecorder(services.engine)
    fails = [True]

    def fail_once(*_: Any) -> None:
        if fails[0]:
            fails[0] = False
            raise SystemExit("not an Exception")  # escapes every `except Exception`

    event.listen(services.engine, "before_cursor_execute", fail_once)
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="recording the build failed: SystemExit"):
        pool.submit(recorder.record, record(artifact_id, 0)).result(30)  # an answer, not a hang
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(recorder.record, record(artifact_id, 1)).result(30) > 0  # the same writer goes on
