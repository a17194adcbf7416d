"""Provenance: how each build got each bucket (compiled, joined, reused, a remembered failure, imported),
recorded by real submits on both ledgers and read back as the build page reads it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select

from compilesvc.builds.control import cancel_build, retry_build
from compilesvc.builds.provenance import How, Origin, at_submit, cache_outcome, counts, origins
from compilesvc.builds.submit import Submitter
from compilesvc.compiles.bucket_compiles import positioned_buckets
from compilesvc.ledger.models import BucketCompile, Build
from compilesvc.services import Services
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.settings import make_settings
from tests.fixtures.submits import BUCKETS, complete_bucket, spec_doc, upload_model


def read(services: Services, build_id: int) -> tuple[Build, dict[int, Origin], list[int]]:
    """The build, each bucket's origin for it, and the bucket compile ids by position."""
    with services.sessions() as session:
        build = session.get_one(Build, build_id)
        buckets = [bucket for bucket, _ in positioned_buckets(session, build.artifact_id)]
        return build, origins(build, buckets), [bucket.id for bucket in buckets]


def keys_of(result: object) -> list[str]:
    return [bucket.key for bucket in result.buckets]  # type: ignore[attr-defined]


def test_each_outcome_records_where_its_buckets_came_from(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(uri)))
    build, got, ids = read(services, first.build_id)
    assert [got[i] for i in ids] == [Origin(How.COMPILED, None)] * 3 and build.buckets_reused == 0
    with services.sessions() as session:  # the compiles remember who queued them
        assert set(session.execute(select(BucketCompile.origin_build_id, BucketCompile.model_name)
                                   .where(BucketCompile.id.in_(ids)))) == {(first.build_id, "tiny")}

    joined = submitter.submit(parse_spec(spec_doc(uri)))
    _, got, ids = read(services, joined.build_id)
    assert [got[i] for i in ids] == [Origin(How.JOINED, first.build_id)] * 3

    for key in keys_of(first):
        complete_bucket(services, key)
    # One more bucket: three reused from the first build, one compiled by this one.
    bigger = submitter.submit(parse_spec(spec_doc(uri, [*BUCKETS, {"batch_size": 8, "seq_len": 64}])))
    build, got, ids = read(services, bigger.build_id)
    assert [got[i] for i in ids] == [Origin(How.REUSED, first.build_id)] * 3 + [Origin(How.COMPILED, None)]
    assert build.buckets_reused == 3 and build.outcome == "new"

    hit = submitter.submit(parse_spec(spec_doc(uri)))
    build, got, ids = read(services, hit.build_id)
    assert hit.outcome == "hit" and build.provenance is None and build.buckets_reused == 3
    assert [got[i] for i in ids] == [Origin(How.REUSED, first.build_id)] * 3


def test_a_remembered_failure_names_its_build_and_a_retry_makes_the_compile_its_own(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services, b"a model that does not compile")
    first = submitter.submit(parse_spec(spec_doc(uri)))
    complete_bucket(services, keys_of(first)[0], state="failed", error_class="compile", error_code="NCC_E001")

    again = submitter.submit(parse_spec(spec_doc(uri)))
    assert again.state == "failed" and again.outcome == "join"
    build, got, ids = read(services, again.build_id)
    assert got[ids[0]] == Origin(How.FAILED, first.build_id)
    assert build.buckets_reused == 0

    retry_build(services, again.build_id)
    build, got, ids = read(services, again.build_id)
    assert got[ids[0]] == Origin(How.COMPILED, None)  # this build's compile now, not the first's
    with services.sessions() as session:
        assert session.get_one(BucketCompile, ids[0]).origin_build_id == again.build_id
    # The first build compiled the failure that was remembered; its page says who compiled it again.
    _, got, _ = read(services, first.build_id)
    assert got[ids[0]] == Origin(How.COMPILED, None, again_by=again.build_id)


def test_a_hit_on_an_artifact_imported_from_the_store_says_so(services: Services, tmp_path: Path,
                                                               sqlite_template: Path) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    built = submitter.submit(parse_spec(spec_doc(uri)))
    for key in keys_of(built):
        complete_bucket(services, key)
    # A second ledger sharing the store (another region, a rebuilt ledger) finds the manifest there.
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    shutil.copyfile(sqlite_template, other_dir / "ledger.db")
    other = Services.from_settings(make_settings(other_dir, f"sqlite:///{other_dir}/ledger.db",
                                                 store_url=services.settings.store_url))
    try:
        imported = Submitter(other).submit(parse_spec(spec_doc(uri)))
        assert imported.outcome == "hit"
        _, got, ids = read(other, imported.build_id)
        assert [got[i].how for i in ids] == [How.IMPORTED] * 3
    finally:
        other.close()


def outcome_of(services: Services, build_id: int) -> str:
    with services.sessions() as session:
        build = session.get_one(Build, build_id)
        return cache_outcome(build.outcome, build.provenance)


def test_what_the_cache_did_comes_from_the_record_not_the_outcome_alone(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    first = submitter.submit(parse_spec(spec_doc(uri)))
    assert outcome_of(services, first.build_id) == "built"
    assert outcome_of(services, submitter.submit(parse_spec(spec_doc(uri))).build_id) == "joined"
    cancel_build(services, first.build_id)
    cancel_build(services, 2)
    # A resubmit of the cancelled set compiles every bucket again itself: new, and built.
    reopened = submitter.submit(parse_spec(spec_doc(uri)))
    assert reopened.outcome == "new" and outcome_of(services, reopened.build_id) == "built"
    for key in keys_of(reopened):
        complete_bucket(services, key)
    # A new set made only of compiled buckets compiles nothing.
    subset = submitter.submit(parse_spec(spec_doc(uri, BUCKETS[:2])))
    assert subset.outcome == "new" and outcome_of(services, subset.build_id) == "reused every bucket"
    with services.sessions() as session:
        build = session.get_one(Build, subset.build_id)
        assert (build.buckets_reused, build.buckets_compiled) == (2, 0)
    more = submitter.submit(parse_spec(spec_doc(uri, [*BUCKETS, {"batch_size": 9, "seq_len": 9}])))
    assert outcome_of(services, more.build_id) == "partly reused (3 of 4)"
    assert outcome_of(services, submitter.submit(parse_spec(spec_doc(uri))).build_id) == "hit"


def test_a_bucket_its_failed_set_never_compiled_is_not_called_joined(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services, b"half of it fails")
    first = submitter.submit(parse_spec(spec_doc(uri)))
    keys = keys_of(first)
    complete_bucket(services, keys[0], state="failed", error_class="compile", error_code="NCC_E001")
    again = submitter.submit(parse_spec(spec_doc(uri)))
    _, got, ids = read(services, again.build_id)
    assert got[ids[0]] == Origin(How.FAILED, first.build_id)
    assert {got[i].how for i in ids[1:]} <= {How.NOT_COMPILED, How.JOINED}
    with services.sessions() as session:
        states = {b.id: b.state for b in session.scalars(select(BucketCompile).where(BucketCompile.id.in_(ids)))}
    for bucket_id in ids[1:]:  # joined only what is in flight
        assert (got[bucket_id].how == How.JOINED) == (states[bucket_id] in ("queued", "running"))
    # A new set holding the remembered failure and one new bucket compiles that bucket, and fails.
    wider = submitter.submit(parse_spec(spec_doc(uri, [BUCKETS[0], {"batch_size": 7, "seq_len": 7}])))
    _, got, ids = read(services, wider.build_id)
    assert [got[i].how for i in ids] == [How.FAILED, How.COMPILED]
    assert wider.state == "failed" and outcome_of(services, wider.build_id) == "built"


@dataclass
class Row:
    """The fields of a bucket compile that decide its provenance."""

    id: int
    state: str
    error_class: str | None = None
    started_at: datetime | None = datetime(2026, 1, 1, tzinfo=UTC)
    origin_build_id: int | None = 7


def test_each_state_of_a_compile_reads_as_one_provenance() -> None:
    rows = [Row(1, "queued"), Row(2, "running"), Row(3, "succeeded"), Row(4, "succeeded", started_at=None),
            Row(5, "failed", "compile"), Row(6, "failed", "infra"), Row(7, "cancelled"), Row(8, "deleted"),
            Row(9, "queued")]
    recorded = at_submit(rows, queued_now={9})
    assert {int(k): (v["how"], v["from_build"]) for k, v in recorded.items()} == {
        1: ("joined", 7), 2: ("joined", 7), 3: ("reused", 7), 4: ("imported", None), 5: ("failed", 7),
        6: ("not-compiled", 7), 7: ("not-compiled", 7), 8: ("not-compiled", 7), 9: ("compiled", None)}
    assert counts(recorded) == (2, 1)
