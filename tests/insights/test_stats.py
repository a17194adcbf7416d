"""Service statistics (compilesvc.insights.stats) on Postgres and SQLite: windows and their bins, outcome counts with
the partly-reused class, nearest-rank percentiles of compile times per model and target (the model name
from the queuing build or the artifact's builds), failures per class, queue waits, and window bounds."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.insights.stats import (
    CompileTimes,
    FailureCount,
    OutcomeBin,
    Percentiles,
    UnknownWindow,
    collect,
    compile_times,
    failures,
    outcomes,
    queue_wait,
    window,
)
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, BucketFailure, Build

NOW = datetime(2026, 3, 10, 14, 25, 7, tzinfo=UTC)
DAY = window("day", NOW)  # 2026-03-09 15:00 .. 2026-03-10 15:00
WEEK = window("week", NOW)  # 2026-03-04 .. 2026-03-11
H = timedelta(hours=1)
_keys = itertools.count(1)


def test_windows_are_clock_aligned_bins_ending_with_the_current_one() -> None:
    assert (DAY.start, DAY.stop, DAY.count) == (datetime(2026, 3, 9, 15, tzinfo=UTC),
                                                 datetime(2026, 3, 10, 15, tzinfo=UTC), 24)
    assert DAY.bins[0] == DAY.start and DAY.bins[-1] == datetime(2026, 3, 10, 14, tzinfo=UTC)
    assert (WEEK.start, WEEK.stop) == (datetime(2026, 3, 4, tzinfo=UTC), datetime(2026, 3, 11, tzinfo=UTC))
    assert WEEK.bins == [datetime(2026, 3, d, tzinfo=UTC) for d in range(4, 11)]
    # A time given in another zone is the same moment; exactly on a boundary opens a new bin.
    paris = datetime(2026, 3, 10, 16, tzinfo=UTC).astimezone(ZoneInfo("Europe/Paris"))
    assert window("day", paris).bins[-1] == datetime(2026, 3, 10, 16, tzinfo=UTC)
    with pytest.raises(UnknownWindow):
        window("month", NOW)


def _artifact(session: Session, target: str = "inf2") -> Artifact:
    artifact = Artifact(key=f"a{next(_keys):063d}", state="published", target=target, sdk="2.20.0",
                        backend="trace", model_sha256="f" * 64, material={}, components={})
    session.add(artifact)
    session.flush()
    return artifact


def _build(session: Session, artifact: Artifact, created_at: datetime, outcome: str = "new",
           reused: int | None = 0, model_name: str | None = "m") -> Build:
    build = Build(artifact_id=artifact.id, artifact_key=artifact.key, state="succeeded", outcome=outcome,
                  labels={}, spec={}, model_name=model_name, model_sha256=artifact.model_sha256,
                  target=artifact.target, sdk=artifact.sdk, backend=artifact.backend, created_at=created_at,
                  buckets_reused=reused,
                  # As submit records it: a hit or a join compiles nothing, a new build here one bucket.
                  buckets_compiled=None if reused is None else (1 if outcome == "new" else 0))
    session.add(build)
    session.flush()
    return build


def _compile(session: Session, artifact: Artifact, *, origin: Build | None, queued_at: datetime,
             started_at: datetime | None = None, finished_at: datetime | None = None,
             seconds: float | None = None, state: str = "succeeded", imported: bool = False) -> BucketCompile:
    if started_at is None and finished_at is not None and not imported:
        started_at = queued_at  # it ran here (an imported compile never started on this ledger's workers)
    compile_ = BucketCompile(key=f"b{next(_keys):063d}", state=state, target=artifact.target,
                             sdk=artifact.sdk, backend="trace", queue="q", model={}, material={}, inputs=[],
                             queued_at=queued_at, started_at=started_at, finished_at=finished_at,
                             compile_seconds=seconds, origin_build_id=origin.id if origin else None,
                             model_name=origin.model_name if origin else None)  # as submit records them
    session.add(compile_)
    session.flush()
    session.add(ArtifactBucket(artifact_id=artifact.id, bucket_compile_id=compile_.id, position=0))
    return compile_


def test_outcomes_per_bin_with_partly_reused(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        a = _artifact(session)
        first = DAY.start  # the first bin, inclusive of its start
        last = DAY.bins[-1] + timedelta(minutes=59, seconds=59)  # the last bin, just before the window ends
        _build(session, a, first, "hit", reused=2)
        _build(session, a, first + timedelta(minutes=30), "join", reused=0)
        _build(session, a, first + timedelta(minutes=59), "new", reused=0)
        _build(session, a, first + timedelta(minutes=59), "new", reused=None)  # before provenance: built
        _build(session, a, first + 5 * H, "new", reused=1)  # partly reused
        _build(session, a, first + 5 * H, "new", reused=3)
        _build(session, a, last, "hit", reused=2)
        _build(session, a, DAY.start - timedelta(microseconds=1), "hit")  # just before the window
        _build(session, a, DAY.stop, "hit")  # the window's end is exclusive
    with sessions() as session:
        bins = outcomes(session, DAY)
    assert [b.start for b in bins] == DAY.bins
    assert bins[0] == OutcomeBin(DAY.start, hit=1, joined=1, built=2, partly_reused=0)
    assert bins[5] == OutcomeBin(DAY.start + 5 * H, partly_reused=2)
    assert bins[23] == OutcomeBin(DAY.bins[-1], hit=1)
    assert sum(b.total for b in bins) == 7
    assert all(b.total == 0 for i, b in enumerate(bins) if i not in (0, 5, 23))
    with sessions() as session:
        week = outcomes(session, WEEK)
    # The day window lies across the last two days of the week, which also holds the builds just before
    # it (on the 9th) and at its end (on the 10th).
    assert [b.total for b in week] == [0, 0, 0, 0, 0, 7, 2]


def test_compile_seconds_percentiles_by_model_and_target(sessions: sessionmaker[Session]) -> None:
    inside = DAY.start + 2 * H
    with sessions() as session, session.begin():
        inf2, cpu, imported = _artifact(session), _artifact(session, "cpu"), _artifact(session)
        bert = _build(session, inf2, inside, model_name="bert")
        bert_cpu = _build(session, cpu, inside, model_name="bert")
        by_sha = _build(session, imported, inside, model_name=None)  # submitted by sha256 alone
        _build(session, imported, inside, model_name="gpt")  # a later build of the same artifact names it
        # 20 values: p50 is the 10th (ceil(0.5*20)), p95 the 19th (ceil(0.95*20)).
        for s in (7, 3, 12, 1, 20, 15, 9, 4, 18, 11, 2, 16, 5, 14, 8, 19, 6, 13, 10, 17):
            _compile(session, inf2, origin=bert, queued_at=inside, finished_at=inside + timedelta(minutes=s),
                     seconds=float(s))
        # 3 values: p50 rank ceil(1.5) = 2, p95 rank ceil(2.85) = 3.
        for value in (30.5, 10.25, 20.0):
            _compile(session, cpu, origin=bert_cpu, queued_at=inside, finished_at=inside, seconds=value)
        _compile(session, imported, origin=None, queued_at=inside, finished_at=inside, seconds=60.0)
        _compile(session, imported, origin=by_sha, queued_at=inside, finished_at=inside, seconds=40.0)
        # Not counted: failed, without seconds, finished outside the window.
        _compile(session, cpu, origin=bert_cpu, queued_at=inside, finished_at=inside, seconds=999.0, state="failed")
        _compile(session, cpu, origin=bert_cpu, queued_at=inside, finished_at=inside, seconds=None)
        _compile(session, cpu, origin=bert_cpu, queued_at=inside, finished_at=DAY.stop, seconds=999.0)
        _compile(session, cpu, origin=bert_cpu, queued_at=inside, finished_at=DAY.start - H, seconds=999.0)
        # Imported from the store: compiled by another ledger, at another time; not this window's compile.
        _compile(session, inf2, origin=None, queued_at=inside, finished_at=inside, seconds=999.0, imported=True)
        orphan = _artifact(session, "trn1")  # no named build at all
        _compile(session, orphan, origin=None, queued_at=inside, finished_at=inside, seconds=5.0)
    with sessions() as session:
        found = compile_times(session, DAY)
    assert found == [
        CompileTimes("gpt", "inf2", Percentiles(2, 40.0, 60.0)),
        CompileTimes("bert", "cpu", Percentiles(3, 20.0, 30.5)),
        CompileTimes("bert", "inf2", Percentiles(20, 10.0, 19.0)),
        CompileTimes(None, "trn1", Percentiles(1, 5.0, 5.0)),
    ]


def test_failures_by_class_retried_and_final(sessions: sessionmaker[Session]) -> None:
    inside = DAY.start + 3 * H
    with sessions() as session, session.begin():
        artifact = _artifact(session)
        compile_ = _compile(session, artifact, origin=None, queued_at=inside, state="failed")

        def fail(at: datetime, error_class: str, retry: bool) -> None:
            session.add(BucketFailure(bucket_compile_id=compile_.id, attempt=1, at=at, phase="compile",
                                      error_class=error_class, retry=retry))

        for _ in range(3):
            fail(inside, "infra", True)
        fail(inside, "infra", False)
        fail(inside, "compile", False)
        fail(inside, "timeout", True)
        fail(DAY.bins[-1], "timeout", True)
        fail(DAY.start - timedelta(seconds=1), "compile", False)  # before the window
        fail(DAY.stop, "unknown", True)  # after it
    with sessions() as session:
        found = failures(session, DAY)
    assert found == [FailureCount("infra", 3, 1), FailureCount("timeout", 2, 0), FailureCount("compile", 0, 1)]
    assert found[0].total == 4


def test_queue_wait_overall_and_per_bin(sessions: sessionmaker[Session]) -> None:
    waits: dict[int, list[float]] = {1: [0.5, 2.0, 30.0, 600.0], 4: [90.0]}
    with sessions() as session, session.begin():
        artifact = _artifact(session)
        for index, seconds in waits.items():
            for wait in seconds:
                started = DAY.bins[index] + timedelta(minutes=10)
                _compile(session, artifact, origin=None, queued_at=started - timedelta(seconds=wait),
                         started_at=started)
        # Queued in the window but started after it, and started before it: neither counts.
        _compile(session, artifact, origin=None, queued_at=DAY.bins[-1], started_at=DAY.stop)
        _compile(session, artifact, origin=None, queued_at=DAY.start - 2 * H, started_at=DAY.start - H)
        _compile(session, artifact, origin=None, queued_at=DAY.start, state="queued")  # not started yet
        # Requeued after its attempt started in the window, and not started again: no wait to count.
        _compile(session, artifact, origin=None, queued_at=DAY.bins[3], started_at=DAY.bins[2], state="queued")
    with sessions() as session:
        found = queue_wait(session, DAY)
    # All five: sorted 0.5, 2, 30, 90, 600; p50 rank 3, p95 rank 5.
    assert found.overall == Percentiles(5, 30.0, 600.0)
    assert found.bins[1] == (DAY.bins[1], Percentiles(4, 2.0, 600.0))
    assert found.bins[4] == (DAY.bins[4], Percentiles(1, 90.0, 90.0))
    assert [p for i, (_, p) in enumerate(found.bins) if i not in (1, 4)] == [Percentiles()] * 22
    with sessions() as session:
        empty = queue_wait(session, window("day", NOW - timedelta(days=30)))
    assert empty.overall == Percentiles() and len(empty.bins) == 24


def test_collect_reads_every_part_of_one_window(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        artifact = _artifact(session, "trn1")
        build = _build(session, artifact, WEEK.bins[2] + H, "new", reused=1, model_name="llama")
        started = WEEK.bins[2] + 2 * H
        _compile(session, artifact, origin=build, queued_at=started - timedelta(seconds=45), started_at=started,
                 finished_at=started + timedelta(seconds=300), seconds=300.0)
    with sessions() as session:
        stats = collect(session, "week", NOW)
    values: dict[str, Any] = {
        "partly": [b.partly_reused for b in stats.outcomes],
        "times": stats.compile_times,
        "wait": stats.queue_wait.overall,
        "failures": stats.failures,
    }
    assert values == {
        "partly": [0, 0, 1, 0, 0, 0, 0],
        "times": [CompileTimes("llama", "trn1", Percentiles(1, 300.0, 300.0))],
        "wait": Percentiles(1, 45.0, 45.0),
        "failures": [],
    }
    with sessions() as session, pytest.raises(UnknownWindow):
        collect(session, "year", NOW)


def test_percentiles_of_a_hundred_are_the_50th_and_95th(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        artifact = _artifact(session, "cpu")
        build = _build(session, artifact, DAY.start, model_name="hundred")
        for seconds in range(100, 0, -1):
            _compile(session, artifact, origin=build, queued_at=DAY.start, finished_at=DAY.start + H,
                     seconds=float(seconds))
    with sessions() as session:
        assert compile_times(session, DAY) == [CompileTimes("hundred", "cpu", Percentiles(100, 50.0, 95.0))]
