"""Build history (compilesvc.insights.history) on Postgres and SQLite: ordering, keyset pagination, every filter
alone and combined, cursors and limits, bounded state counts and the build detail."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.insights.history import (
    MAX_LIMIT,
    HistoryError,
    HistoryFilter,
    InvalidCursor,
    InvalidLimit,
    Page,
    count_by_state,
    decode_cursor,
    encode_cursor,
    get_build_detail,
    list_builds,
)
from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, BuildLabel, Event

# SDK releases per target; 2.20.2 is shared by inf2 and trn1, so target and sdk filters overlap partially.
TARGETS = {"inf2": ("2.21.0", "2.20.2"), "trn1": ("2.20.2",), "trn2": ("2.22.0",), "cpu": ("2.13.0",)}
STATES = ["succeeded", "succeeded", "succeeded", "failed", "cancelled", "building"]
USERS = ["alice", "bob", "carol", None]
MODELS = [(f"model-{i}", f"{i:x}" * 64) for i in range(1, 6)]
N_BUILDS = 150


@dataclass(frozen=True)
class Row:
    """What a seeded build looks like, kept in Python to compute the expected answer of each filter."""

    id: int
    target: str
    sdk: str
    state: str
    model_name: str | None
    model_sha256: str
    submitted_by: str | None
    labels: dict[str, str]


@dataclass
class Ledger:
    engine: Engine
    sessions: sessionmaker[Session]
    rows: list[Row]

    def expected(self, keep: Callable[[Row], bool]) -> list[int]:
        return sorted((r.id for r in self.rows if keep(r)), reverse=True)

    def page(self, filters: HistoryFilter | None = None, **kwargs: Any) -> Page:
        with self.sessions() as session:
            return list_builds(session, filters, **kwargs)

    def walk(self, filters: HistoryFilter | None = None, limit: int = 7) -> list[list[int]]:
        """Every page of a listing, following next_cursor to the end."""
        pages: list[list[int]] = []
        cursor: str | None = None
        while True:
            page = self.page(filters, limit=limit, cursor=cursor)
            pages.append([b.id for b in page.items])
            assert len(pages) <= N_BUILDS + 1, "pagination does not terminate"
            if page.next_cursor is None:
                return pages
            assert len(page.items) == limit, "only the last page may be short"
            cursor = page.next_cursor


def _artifact(key: str, target: str, sdk: str, sha: str, state: str = "published") -> Artifact:
    return Artifact(
        key=key.ljust(64, "0"),
        state=state,
        target=target,
        sdk=sdk,
        backend="trace",
        model_sha256=sha,
        material={},
        components={},
    )


def _build(artifact: Artifact, **overrides: Any) -> Build:
    values: dict[str, Any] = {
        "artifact_id": artifact.id,
        "artifact_key": artifact.key,
        "state": "succeeded",
        "outcome": "new",
        "submitted_by": None,
        "labels": {},
        "spec": {},
        "model_name": None,
        "model_sha256": artifact.model_sha256,
        "target": artifact.target,
        "sdk": artifact.sdk,
        "backend": artifact.backend,
    }
    values.update(overrides)
    return Build(**values)


def _labels_for(rng: random.Random, i: int) -> dict[str, str]:
    labels = {"team": rng.choice(["vision", "speech", "ranking"])}
    if rng.random() < 0.3:
        labels["env"] = rng.choice(["prod", "dev"])
    if i % 10 == 0:
        labels["ticket"] = f"T-{i}"
    if i % 25 == 0:
        labels["url"] = "https://models.example/x:1"  # values may contain the ":" separator
    if i % 30 == 0:
        labels["flag"] = ""  # empty values are allowed by CompileSpec
    return labels


def _seed(sessions: sessionmaker[Session]) -> list[Row]:
    rng = random.Random(20261121)
    rows: list[Row] = []
    with sessions() as session, session.begin():
        artifacts: dict[tuple[str, str, str], Artifact] = {}
        for target, sdks in TARGETS.items():
            for sdk in sdks:
                for name, sha in MODELS:
                    key = f"{target}{sdk}{name}".replace("-", "").replace(".", "")
                    artifacts[(target, sdk, name)] = _artifact(key, target, sdk, sha)
        session.add_all(artifacts.values())
        session.flush()
        builds: list[tuple[Build, dict[str, str]]] = []
        for i in range(N_BUILDS):
            target = rng.choice(list(TARGETS))
            sdk = rng.choice(TARGETS[target])
            name, _ = rng.choice(MODELS)
            labels = _labels_for(rng, i)
            build = _build(
                artifacts[(target, sdk, name)],
                state=rng.choice(STATES),
                submitted_by=rng.choice(USERS),
                model_name=None if i % 9 == 0 else name,  # submitted by sha256 alone
                labels=labels,
            )
            builds.append((build, labels))
        session.add_all(build for build, _ in builds)
        session.flush()  # one multi-row INSERT; ids are assigned in order
        for build, labels in builds:
            session.add_all(BuildLabel(build_id=build.id, name=k, value=v) for k, v in labels.items())
            rows.append(
                Row(
                    build.id,
                    build.target,
                    build.sdk,
                    build.state,
                    build.model_name,
                    build.model_sha256,
                    build.submitted_by,
                    labels,
                )
            )
    return rows


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    engine = make_engine(ledger_url)
    sessions = make_sessionmaker(engine)
    try:
        yield Ledger(engine, sessions, _seed(sessions))
    finally:
        engine.dispose()


def test_newest_first_by_id(ledger: Ledger) -> None:
    page = ledger.page()
    assert [b.id for b in page.items] == ledger.expected(lambda r: True)[:50]
    assert page.next_cursor == encode_cursor(page.items[-1].id)
    assert all(isinstance(b, Build) and b.labels is not None for b in page.items)


@pytest.mark.parametrize("limit", [1, 7, 50, N_BUILDS, MAX_LIMIT])
def test_pagination_visits_every_build_once(ledger: Ledger, limit: int) -> None:
    pages = ledger.walk(limit=limit)
    ids = [i for page in pages for i in page]
    assert ids == ledger.expected(lambda r: True)  # all of them, in order, so no duplicates or gaps
    assert len(ids) == len(set(ids))
    # No trailing empty page when the count is a multiple of the limit (the extra row decides).
    assert len(pages) == -(-N_BUILDS // limit)


def test_pages_ahead_do_not_shift_when_builds_are_added(ledger: Ledger) -> None:
    first = ledger.page(limit=10)
    assert first.next_cursor is not None
    with ledger.sessions() as session, session.begin():
        artifact = session.query(Artifact).first()
        assert artifact is not None
        session.add_all(_build(artifact) for _ in range(5))
    second = ledger.page(limit=10, cursor=first.next_cursor)
    assert [b.id for b in second.items] == ledger.expected(lambda r: True)[10:20]


FILTERS: list[tuple[str, HistoryFilter, Callable[[Row], bool]]] = [
    ("target", HistoryFilter(target="trn1"), lambda r: r.target == "trn1"),
    ("sdk", HistoryFilter(sdk="2.22.0"), lambda r: r.sdk == "2.22.0"),
    ("sdk_shared", HistoryFilter(sdk="2.20.2"), lambda r: r.sdk == "2.20.2"),
    ("state", HistoryFilter(state="failed"), lambda r: r.state == "failed"),
    ("submitted_by", HistoryFilter(submitted_by="bob"), lambda r: r.submitted_by == "bob"),
    ("model_name", HistoryFilter(model="model-2"), lambda r: r.model_name == "model-2"),
    # By sha256 the builds submitted without a name match too.
    ("model_sha256", HistoryFilter(model="2" * 64), lambda r: r.model_sha256 == "2" * 64),
    ("label", HistoryFilter(label="team:speech"), lambda r: r.labels.get("team") == "speech"),
    ("label_rare", HistoryFilter(label="ticket:T-40"), lambda r: r.labels.get("ticket") == "T-40"),
    ("label_colon_value", HistoryFilter(label="url:https://models.example/x:1"), lambda r: "url" in r.labels),
    ("label_empty_value", HistoryFilter(label="flag:"), lambda r: r.labels.get("flag") == ""),
    ("label_wrong_name", HistoryFilter(label="env:speech"), lambda r: False),
    ("no_match", HistoryFilter(target="nope"), lambda r: False),
    # target and sdk together are one composite-index stream (ix_builds_target_sdk_id).
    ("target_sdk", HistoryFilter(target="inf2", sdk="2.20.2"), lambda r: r.target == "inf2" and r.sdk == "2.20.2"),
    ("target_sdk_none", HistoryFilter(target="trn1", sdk="2.21.0"), lambda r: False),
    (
        "target_sdk_state_label",
        HistoryFilter(target="inf2", sdk="2.21.0", state="succeeded", label="team:speech"),
        lambda r: (
            r.target == "inf2" and r.sdk == "2.21.0" and r.state == "succeeded" and r.labels.get("team") == "speech"
        ),
    ),
    (
        "target_state_label",
        HistoryFilter(target="inf2", state="succeeded", label="team:vision"),
        lambda r: r.target == "inf2" and r.state == "succeeded" and r.labels.get("team") == "vision",
    ),
    (
        "model_sha_target_user",
        HistoryFilter(model="3" * 64, target="cpu", submitted_by="alice"),
        lambda r: r.model_sha256 == "3" * 64 and r.target == "cpu" and r.submitted_by == "alice",
    ),
    (
        "model_label_sdk",
        HistoryFilter(model="model-1", label="team:vision", sdk="2.20.2"),
        lambda r: r.model_name == "model-1" and r.labels.get("team") == "vision" and r.sdk == "2.20.2",
    ),
    (
        "everything",
        HistoryFilter(
            model="model-1",
            target="trn2",
            sdk="2.22.0",
            state="succeeded",
            submitted_by="carol",
            label="team:vision",
        ),
        lambda r: (
            r.model_name == "model-1"
            and r.target == "trn2"
            and r.sdk == "2.22.0"
            and r.state == "succeeded"
            and r.submitted_by == "carol"
            and r.labels.get("team") == "vision"
        ),
    ),
]


@pytest.mark.parametrize(("filters", "keep"), [f[1:] for f in FILTERS], ids=[f[0] for f in FILTERS])
def test_filters(ledger: Ledger, filters: HistoryFilter, keep: Callable[[Row], bool]) -> None:
    expected = ledger.expected(keep)
    pages = ledger.walk(filters, limit=3)  # small pages: the cursor must work with every query shape
    assert [i for page in pages for i in page] == expected
    assert ledger.page(filters, limit=MAX_LIMIT).next_cursor is None


def test_filter_values_are_not_trivially_empty(ledger: Ledger) -> None:
    # Guards the test above: each case meant to match selects some, but not all, builds (the seed is fixed,
    # so this only fails if the seeding changes).
    counts = {name: len(ledger.expected(keep)) for name, _, keep in FILTERS}
    empty = {"label_wrong_name", "no_match", "target_sdk_none"}
    assert all(counts[name] == 0 for name in empty)
    assert all(1 <= n < N_BUILDS for name, n in counts.items() if name not in empty), str(counts)
    single = ("target", "sdk", "sdk_shared", "state", "submitted_by", "model_name", "model_sha256", "label")
    assert all(counts[name] > 9 for name in single), str(counts)  # several pages of 3 each


def test_model_matches_name_or_sha_once(ledger: Ledger) -> None:
    # A build whose name is the sha of another model, and one whose name equals its own sha.
    other_sha = MODELS[0][1]
    with ledger.sessions() as session, session.begin():
        artifact = session.query(Artifact).filter_by(model_sha256=MODELS[1][1]).first()
        assert artifact is not None
        named_like_sha = _build(artifact, model_name=other_sha)
        own = _build(artifact, model_name=MODELS[1][1])
        session.add_all([named_like_sha, own])
    by_other = [i for page in ledger.walk(HistoryFilter(model=other_sha), limit=4) for i in page]
    assert by_other == sorted(
        [named_like_sha.id, *(r.id for r in ledger.rows if r.model_sha256 == other_sha)], reverse=True
    )
    # It matches both halves of the model query; it must count once, also towards the page size.
    by_own = [i for page in ledger.walk(HistoryFilter(model=MODELS[1][1]), limit=4) for i in page]
    assert by_own == sorted(
        [own.id, named_like_sha.id, *(r.id for r in ledger.rows if r.model_sha256 == MODELS[1][1])], reverse=True
    )


BAD_CURSORS = [
    "",
    "!!!!",
    "a b",
    "MTA=",  # padded form of "10": only the canonical unpadded cursor is accepted
    "MTA\n",
    base64.urlsafe_b64encode(b"abc").decode(),  # not a number
    base64.urlsafe_b64encode(b"0").decode().rstrip("="),  # ids start at 1
    base64.urlsafe_b64encode(b"-5").decode().rstrip("="),
    base64.urlsafe_b64encode(b"007").decode().rstrip("="),  # not canonical
    base64.urlsafe_b64encode(b"\xff\xfe").decode().rstrip("="),  # not ascii
    base64.urlsafe_b64encode(str(2**63).encode()).decode().rstrip("="),  # beyond BIGINT
    "MTA" * 100,
    "M",  # impossible base64 length
    "MTB",  # "10" with stray low bits set
]


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_invalid_cursor(cursor: str) -> None:
    with pytest.raises(InvalidCursor, match="malformed cursor"):
        decode_cursor(cursor)


def test_invalid_cursor_from_list_builds(ledger: Ledger) -> None:
    for cursor in BAD_CURSORS:
        with pytest.raises(InvalidCursor, match="malformed cursor"):
            ledger.page(cursor=cursor)
    assert issubclass(InvalidCursor, HistoryError)
    assert issubclass(InvalidCursor, ValueError)  # what the API maps to a 400 problem


def test_cursor_past_the_oldest_build_gives_an_empty_last_page(ledger: Ledger) -> None:
    oldest = min(r.id for r in ledger.rows)
    assert ledger.page(cursor=encode_cursor(oldest)) == Page(items=[], next_cursor=None)


@given(st.integers(min_value=1, max_value=2**63 - 1))
def test_cursor_round_trip(build_id: int) -> None:
    cursor = encode_cursor(build_id)
    assert decode_cursor(cursor) == build_id
    assert cursor.replace("-", "").replace("_", "").isalnum()  # URL-safe, no padding


def test_limit_out_of_bounds(ledger: Ledger) -> None:
    for limit in (0, -1, MAX_LIMIT + 1, 10_000, True):
        with pytest.raises(InvalidLimit, match=f"from 1 to {MAX_LIMIT}"):
            ledger.page(limit=limit)


def test_limit_bounds_and_default(ledger: Ledger) -> None:
    assert len(ledger.page(limit=1).items) == 1
    assert len(ledger.page(limit=MAX_LIMIT).items) == N_BUILDS
    assert len(ledger.page().items) == 50


@pytest.mark.parametrize("label", ["team", ":vision", "x" * 65 + ":v"])
def test_malformed_label_filter(label: str) -> None:
    with pytest.raises(ValidationError, match="label"):
        HistoryFilter(label=label)


def test_filter_blank_is_any_and_unknown_fields_rejected() -> None:
    assert HistoryFilter(target="", label="", model="") == HistoryFilter()
    assert HistoryFilter(label="a:b:c").label_pair == ("a", "b:c")
    with pytest.raises(ValidationError):
        HistoryFilter(colour="red")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        HistoryFilter(target="t" * 17)


def test_count_by_state(ledger: Ledger) -> None:
    exact = {s: sum(r.state == s for r in ledger.rows) for s in ("building", "succeeded", "failed", "cancelled")}
    with ledger.sessions() as session:
        counts = count_by_state(session, cap=10_000)
        assert {s: c.count for s, c in counts.items()} == exact
        assert all(c.exact for c in counts.values())
        capped = count_by_state(session, cap=exact["succeeded"] - 1)
        assert capped["succeeded"].count == exact["succeeded"] - 1
        assert not capped["succeeded"].exact
        assert count_by_state(session, states=["unknown"])["unknown"].count == 0


class _Selects:
    """Counts the SELECT statements an engine runs."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            self.count += 1


def test_build_detail(ledger: Ledger) -> None:
    with ledger.sessions() as session, session.begin():
        artifact = _artifact("detail", "inf2", "2.21.0", "d" * 64, state="building")
        session.add(artifact)
        session.flush()
        buckets = [
            BucketCompile(
                key=f"bucket{i}".ljust(64, "0"),
                state="queued",
                target="inf2",
                sdk="2.21.0",
                backend="trace",
                queue="neuron",
                model={},
                material={},
                inputs=[],
            )
            for i in range(3)
        ]
        session.add_all(buckets)
        session.flush()
        # Linked in an order that differs from id order: the detail follows position.
        for position, bucket in zip([2, 0, 1], buckets, strict=True):
            session.add(ArtifactBucket(artifact_id=artifact.id, bucket_compile_id=bucket.id, position=position))
        build = _build(artifact, state="building")
        other = _build(artifact, state="building")
        session.add_all([build, other])
        session.flush()
        session.add_all(
            [
                Event(entity="build", entity_id=build.id, from_state=None, to_state="building"),
                Event(entity="artifact", entity_id=artifact.id, from_state=None, to_state="building"),
                Event(entity="bucket", entity_id=buckets[0].id, from_state="queued", to_state="running"),
                Event(entity="build", entity_id=other.id, from_state=None, to_state="building"),
                # Same entity_id as the build, different entity: must not be mixed in.
                Event(entity="bucket", entity_id=build.id, from_state=None, to_state="queued"),
                Event(entity="artifact", entity_id=artifact.id, from_state="building", to_state="failed"),
                Event(entity="build", entity_id=build.id, from_state="building", to_state="failed"),
            ]
        )
    selects = _Selects(ledger.engine)
    with ledger.sessions() as session:
        detail = get_build_detail(session, build.id)
        newest_two = get_build_detail(session, build.id, event_limit=2)
    assert selects.count == 6  # three per call, whatever the number of buckets and events
    assert detail is not None and newest_two is not None
    assert detail.build.id == build.id
    assert detail.artifact.id == artifact.id
    assert [b.id for b in detail.buckets] == [buckets[1].id, buckets[2].id, buckets[0].id]
    assert [(e.entity, e.to_state) for e in detail.events] == [
        ("build", "building"),
        ("artifact", "building"),
        ("artifact", "failed"),
        ("build", "failed"),
    ]
    assert [(e.entity, e.to_state) for e in newest_two.events] == [("artifact", "failed"), ("build", "failed")]


def test_build_detail_missing_build(ledger: Ledger) -> None:
    selects = _Selects(ledger.engine)
    with ledger.sessions() as session:
        assert get_build_detail(session, 10**12) is None
    assert selects.count == 1


def test_build_detail_without_buckets_or_events(ledger: Ledger) -> None:
    with ledger.sessions() as session:
        detail = get_build_detail(session, ledger.rows[0].id)
    assert detail is not None
    assert detail.buckets == [] and detail.events == []
    assert detail.artifact.target == ledger.rows[0].target
