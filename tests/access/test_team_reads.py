"""The team boundary's conditions (compilesvc.access.team_reads) on Postgres and SQLite: who is bounded, builds without
a team, artifacts shared through deduplication, pins, and the memory of readable keys."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.access import team_reads
from compilesvc.access.team_reads import EVERYTHING, Reader, VisibleKeys
from compilesvc.access.tokens import Principal, Scope
from compilesvc.insights.artifact_index import ArtifactFilter, list_artifacts
from compilesvc.insights.history import count_by_state, list_builds
from compilesvc.ledger.models import Artifact, Build, BuildLabel
from compilesvc.ledger.retention import RetentionPin

_keys = itertools.count(1)
VISION, NLP, NO_TEAM = Reader(True, "vision"), Reader(True, "nlp"), Reader(True, None)


def _principal(scope: Scope, team: str = "vision") -> Principal:
    return Principal(token_id=1, name="t", owner="o", team=team, scopes=frozenset({scope}), expires_at=None)


def test_who_is_bounded() -> None:
    for scope in (Scope.FLEET, Scope.READ, Scope.SUBMIT):
        assert team_reads.reader_for(_principal(scope), True) == VISION
        assert team_reads.reader_for(_principal(scope), False) == EVERYTHING
    assert team_reads.reader_for(_principal(Scope.ADMIN), True) == EVERYTHING
    assert team_reads.reader_for(None, True) == NO_TEAM
    assert not NO_TEAM.may_read_team(None) and not VISION.may_read_team(None) and EVERYTHING.may_read_team(None)
    assert VISION.may_read_team("vision") and not VISION.may_read_team("nlp")


def _artifact(session: Session) -> Artifact:
    artifact = Artifact(key=f"k{next(_keys)}".ljust(64, "0"), state="published", target="cpu", sdk="2.20.0",
                        backend="trace", model_sha256="f" * 64, material={}, components={})
    session.add(artifact)
    session.flush()
    return artifact


def _build(session: Session, artifact: Artifact, team: str | None, name: str, label: str = "x") -> Build:
    build = Build(artifact_id=artifact.id, artifact_key=artifact.key, state="succeeded", outcome="new",
                  labels={"project": label}, spec={}, model_name=name, model_sha256=artifact.model_sha256,
                  target="cpu", sdk="2.20.0", backend="trace", team=team, created_at=datetime(2026, 3, 1, tzinfo=UTC))
    session.add(build)
    session.flush()
    session.add(BuildLabel(build_id=build.id, name="project", value=label))
    return build


def test_builds_artifacts_and_pins_of_each_team(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        mine, shared, legacy = _artifact(session), _artifact(session), _artifact(session)
        _build(session, mine, "vision", "v-model", "v-label")
        _build(session, shared, "vision", "shared")
        newest_nlp = _build(session, shared, "nlp", "shared-by-nlp")
        _build(session, legacy, None, "old")
        session.add_all([RetentionPin(kind=kind, value=value) for kind, value in (
            ("artifact", mine.key), ("model", "v-model"), ("label", "project:v-label"), ("model", "shared-by-nlp"),
            ("model", "old"))])
    with sessions() as session:
        def names(reader: Reader) -> set[str | None]:
            return {b.model_name for b in list_builds(session, reader=reader).items}

        assert names(VISION) == {"v-model", "shared"} and names(NLP) == {"shared-by-nlp"}
        assert names(NO_TEAM) == set() and "old" in names(EVERYTHING)
        assert count_by_state(session, reader=NLP)["succeeded"].count == 1
        assert count_by_state(session, reader=EVERYTHING)["succeeded"].count == 4
        nlp_page = list_artifacts(session, ArtifactFilter(), reader=NLP).items
        assert [(a.key, a.model_name, a.newest_build_id) for a in nlp_page] == [
            (shared.key, "shared-by-nlp", newest_nlp.id)]
        assert {a.key for a in list_artifacts(session, ArtifactFilter(), reader=VISION).items} == {mine.key, shared.key}
        assert team_reads.may_read_key(session, NLP, shared.key) and not team_reads.may_read_key(session, NLP, mine.key)
        assert not team_reads.may_read_key(session, VISION, legacy.key)

        def pins(reader: Reader) -> set[str]:
            return set(session.scalars(select(RetentionPin.value).where(*team_reads.pin_conditions(reader))))

        assert pins(VISION) == {mine.key, "v-model", "project:v-label"}
        assert pins(NLP) == {"shared-by-nlp"} and pins(NO_TEAM) == set() and "old" in pins(EVERYTHING)


def test_readable_keys_are_remembered_and_unreadable_ones_are_not(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        artifact = _artifact(session)
        key = artifact.key
    visible = VisibleKeys(sessions, ttl=0.3)
    assert not visible.readable(VISION, key)
    with sessions() as session, session.begin():
        _build(session, session.get_one(Artifact, artifact.id), "vision", "m")  # vision's first build of it
    assert visible.readable(VISION, key)  # at once: a "no" was not remembered
    with sessions() as session, session.begin():
        for build in session.scalars(select(Build).where(Build.artifact_id == artifact.id)):
            build.team = "elsewhere"  # only to see what is remembered: builds never change team
    assert visible.readable(VISION, key)  # remembered
    time.sleep(0.35)
    assert not visible.readable(VISION, key)  # the memory ran out
    assert visible.readable(EVERYTHING, key) and not visible.readable(NO_TEAM, key)
