"""Provenance: how each build got each bucket (compiled, joined, reused, a remembered failure, imported),
recorded by real submits on both ledgers and read back as the build page reads it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from compilesvc.bucket_compiles import positioned_buckets
from compilesvc.control import retry_build
from compilesvc.ledger.models import BucketCompile, Build
from compilesvc.provenance import How, Origin, origins
from compilesvc.services import Services
from compilesvc.spec_parsing import parse_spec
from compilesvc.submit import Submitter
from tests.fixtures.settings import make_settings
from tests.test_dedupe import BUCKETS, complete_bucket, spec_doc, upload_model


@pytest.fixture
def services(tmp_path: Path, ledger_url: str):  # type: ignore[no-untyped-def]
    services = Services.from_settings(make_settings(tmp_path, ledger_url))
    yield services
    services.close()


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
    # The first build's record is unchanged: it compiled the failure that was remembered.
    _, got, _ = read(services, first.build_id)
    assert got[ids[0]] == Origin(How.COMPILED, None)


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
