"""Build history for the API and the UI: a filtered, keyset-paginated listing and one build's detail.

The listing has to stay fast with millions of builds:

- Keyset pagination (``WHERE id < :last_id ORDER BY id DESC``) instead of OFFSET, whose cost grows with
  the page number, and which skips or repeats rows when builds are added between two page requests.
- No ``COUNT(*)``: counting a filter's matches reads every match. Whether there is a next page comes from
  one extra row fetched; :func:`count_by_state` gives the UI counts that are bounded in cost.
- The page's ids come from indexes alone: every filter is an index-only walk of its ``(column, id)`` index
  (``(name, value, build_id)`` for a label) in id order from the cursor, several filters are intersected
  by joining those walks on the id, and only the page's rows are then read from ``builds``. A single
  filter costs ``limit + 1`` index entries however many builds exist or how deep the page is.
- ``model`` matches ``model_name`` *or* ``model_sha256``. An ``OR`` across two indexes cannot come out in
  id order (Postgres would fetch every build of a popular model and sort them), so each side is its own
  walk limited to ``limit + 1`` ids, and the union of the two small sets is cut to the page.

Known cost limit: when several filters are combined and their matches rarely coincide in the newest builds
(say ``target=inf2`` with an SDK last used long ago, or a combination that matches nothing), the
intersection reads the more common filter's index entries down to the first matches, all of them in the
worst case. That is index-only and sequential, tens of milliseconds at a million builds, but it grows with
the table; a combination that becomes a hot path deserves its own composite index.

The indexes this relies on are declared on :class:`~compilesvc.ledger.models.Build` and
:class:`~compilesvc.ledger.models.BuildLabel`; ``python -m bench.history_scale`` times the queries and
checks their plans at a million builds.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Select, and_, func, literal, or_, select, union, union_all
from sqlalchemy.orm import InstrumentedAttribute, Session, aliased
from sqlalchemy.sql.elements import ColumnElement

from compilesvc.access.team_reads import EVERYTHING, Reader, build_conditions
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, BuildLabel, Event
from compilesvc.states import BucketState, BuildState

__all__ = [
    "BUILD_STATES",
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "BuildDetail",
    "HistoryError",
    "HistoryFilter",
    "InvalidCursor",
    "InvalidLimit",
    "ListingFilter",
    "Page",
    "StateCount",
    "count_by_state",
    "decode_cursor",
    "encode_cursor",
    "failure_of_artifacts",
    "get_build_detail",
    "list_builds",
    "list_statement",
]

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
DETAIL_EVENT_LIMIT = 100
BUILD_STATES: tuple[str, ...] = tuple(BuildState)

# Ids are positive BIGINTs; a cursor is the decimal id, base64url-encoded without padding.
_MAX_ID = 2**63 - 1
_MAX_CURSOR_CHARS = 26  # the 19 digits of the largest id encode to 26 characters
_CURSOR_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class HistoryError(ValueError):
    """A history request the caller got wrong; the API answers it with a 400 problem."""


class InvalidCursor(HistoryError):
    """The ``cursor`` is not one this service handed out."""


class InvalidLimit(HistoryError):
    """The page size is outside ``1..MAX_LIMIT``."""


def _blank_allowed(schema: dict[str, Any]) -> None:
    """Document that ``""`` is accepted (as "any") beside the enum's values."""
    schema["anyOf"] = [*schema.get("anyOf", ()), {"const": ""}]


class ListingFilter(BaseModel):
    """The filters the build and artifact listings share (:class:`HistoryFilter`,
    :class:`compilesvc.insights.artifact_index.ArtifactFilter`). Every given field must match (AND); ``None`` or ``""``
    means any.

    ``""`` counts as "not given" so that a UI form's empty fields and ``?target=`` in a URL don't filter
    for an impossible empty value. Lengths are capped at the column sizes, which no stored value exceeds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(default=None, max_length=200, description="A model_name or a model_sha256.")
    target: str | None = Field(default=None, max_length=16)
    sdk: str | None = Field(default=None, max_length=32)

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return None if value == "" else value


class HistoryFilter(ListingFilter):
    """Which builds to list (:class:`ListingFilter`, and the build's state, a label, its submitter)."""

    state: BuildState | None = Field(default=None, json_schema_extra=_blank_allowed)
    label: str | None = Field(
        default=None, max_length=64 + 1 + 1024, description='"name:value"; the value may be empty.',
        json_schema_extra={"pattern": "^([^:\\u0000]{1,64}:[^\\u0000]{0,1024})?$"},
    )
    submitted_by: str | None = Field(default=None, max_length=255)

    @field_validator("label")
    @classmethod
    def _label_form(cls, label: str | None) -> str | None:
        if label is None:
            return None
        name, sep, value = label.partition(":")
        if not sep or not name:
            raise ValueError('label filter must be "name:value" with a non-empty name, e.g. "team:vision"')
        if len(name) > 64 or len(value) > 1024:
            raise ValueError("label name is at most 64 characters and its value at most 1024")
        return label

    @property
    def label_pair(self) -> tuple[str, str] | None:
        """The label filter split at its first ``:`` (so values may contain colons, names may not)."""
        if self.label is None:
            return None
        name, _, value = self.label.partition(":")
        return name, value


@dataclass(frozen=True)
class Page:
    """One page of builds, newest first. ``next_cursor`` is None on the last page."""

    items: list[Build]
    next_cursor: str | None


@dataclass(frozen=True)
class BuildDetail:
    """A build with its artifact, the artifact's bucket compiles and the recent events of both.

    ``buckets`` are in the artifact's bucket order (``artifact_buckets.position``). ``events`` are the
    newest :data:`DETAIL_EVENT_LIMIT` events of the build and its artifact, oldest first (a timeline).
    """

    build: Build
    artifact: Artifact
    buckets: list[BucketCompile]
    events: list[Event]


@dataclass(frozen=True)
class StateCount:
    """A bounded count: ``exact`` is False when counting stopped at the cap ("1,000+")."""

    count: int
    exact: bool


def encode_cursor(build_id: int) -> str:
    """The opaque cursor that continues a listing after the build ``build_id``."""
    if not 0 < build_id <= _MAX_ID:
        raise ValueError(f"build ids are positive 64-bit integers, got {build_id}")
    return base64.urlsafe_b64encode(str(build_id).encode("ascii")).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The build id a cursor continues after; :class:`InvalidCursor` unless it is exactly one we made."""
    problem = "malformed cursor: pass back the next_cursor of a previous page unchanged"
    # The length check comes first so that a huge query parameter costs nothing to reject.
    if not isinstance(cursor, str) or not 0 < len(cursor) <= _MAX_CURSOR_CHARS or not _CURSOR_RE.match(cursor):
        raise InvalidCursor(problem)
    try:
        decoded = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidCursor(problem) from None
    if not decoded.isascii() or not decoded.isdigit():
        raise InvalidCursor(problem)
    build_id = int(decoded)
    # Only the canonical encoding of an id in range is accepted ("007", padded forms and encodings with
    # stray trailing bits are not), so each id has exactly one cursor.
    if not 0 < build_id <= _MAX_ID or encode_cursor(build_id) != cursor:
        raise InvalidCursor(problem)
    return build_id


def _check_limit(limit: int) -> None:
    # bool is an int subclass; limit=True is a bug in the caller, not a page size of one.
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidLimit(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")


# Column filters, each served by a (column, id) index on builds.
_COLUMN_FILTERS = ("target", "sdk", "state", "submitted_by")
# Filters that, given together, are one stream on a composite (column, column, id) index.
_COMPOSITE_STREAMS: tuple[tuple[str, ...], ...] = (("target", "sdk"),)


def _matching_ids(
    filters: HistoryFilter, *, limit: int, before_id: int | None, model_column: str | None,
    reader: Reader = EVERYTHING,
) -> Select[int]:
    """Ids of the newest ``limit`` builds that match, below ``before_id``.

    Each filter is its own "stream": a separate alias of ``builds`` (or of ``build_labels``) with one
    equality condition, joined to the others on the build id. Every stream is then an index-only walk of its
    ``(column, id)`` index in id order, and the planner intersects the streams with merge or nested-loop
    joins that stop as soon as the page is full. Filters with a composite index (``_COMPOSITE_STREAMS``)
    share one stream when given together. The alternative, one ``builds`` row with all conditions,
    lets the planner walk the primary key (or one index) and test the other columns on each heap row; it
    assumes matches are spread evenly over the ids, and when they are not (an SDK or model only used long
    ago) that walk reads most of the table to fill one page.
    """
    given = {column: value for column in _COLUMN_FILTERS if (value := getattr(filters, column)) is not None}
    if model_column is not None and filters.model is not None:
        given[model_column] = filters.model
    groups: list[tuple[str, ...]] = [
        columns for columns in _COMPOSITE_STREAMS if all(column in given for column in columns)
    ]
    grouped = {column for columns in groups for column in columns}
    groups += [(column,) for column in given if column not in grouped]
    streams: list[tuple[Any, InstrumentedAttribute[int], ColumnElement[bool] | None]] = []
    for columns in groups:
        stream = aliased(Build, name="by_" + "_".join(columns))
        streams.append((stream, stream.id, and_(*(getattr(stream, column) == given[column] for column in columns))))
    label = filters.label_pair
    if label is not None:
        labelled = aliased(BuildLabel, name="by_label")
        # (build_id, name) is build_labels' primary key: at most one row per build for a given name.
        streams.append((labelled, labelled.build_id, and_(labelled.name == label[0], labelled.value == label[1])))
    bounded = build_conditions(reader, scoped := aliased(Build, name="by_team"))
    if bounded:
        # The team boundary (compilesvc.access.team_reads) is one more stream, so that pages and cursors count
        # only the reader's builds.
        streams.append((scoped, scoped.id, bounded[0]))
    if not streams:
        streams.append((Build, Build.id, None))

    first_id = streams[0][1]
    stmt: Select[int] = select(first_id)
    for entity, stream_id, _ in streams[1:]:
        stmt = stmt.join(entity, stream_id == first_id)
    conditions = [condition for _, _, condition in streams if condition is not None]
    if before_id is not None:
        # On every stream: the planner does not carry inequalities across a join, and each index walk
        # should start at the cursor rather than at the newest build.
        conditions.extend(stream_id < before_id for _, stream_id, _ in streams)
    return stmt.where(*conditions).order_by(first_id.desc()).limit(limit)


def list_statement(filters: HistoryFilter, *, limit: int, before_id: int | None,
                   reader: Reader = EVERYTHING) -> Select[Build]:
    """The SELECT behind :func:`list_builds`: up to ``limit`` builds (pass limit + 1 to probe for a next
    page) with ``id < before_id``, newest first. Public so that the benchmark can EXPLAIN the real query.

    The page's ids are found from the indexes alone (:func:`_matching_ids`); only those rows are read.
    """
    if filters.model is None:
        page_ids = _matching_ids(filters, limit=limit, before_id=before_id, model_column=None, reader=reader)
    else:
        by_name = _matching_ids(filters, limit=limit, before_id=before_id, model_column="model_name", reader=reader)
        by_sha = _matching_ids(filters, limit=limit, before_id=before_id, model_column="model_sha256",
                               reader=reader)
        # UNION, not UNION ALL: a build whose model_name equals its sha256 is in both halves, and a
        # duplicate would take a place on the page (and could hide that there is a next page).
        halves = [select(half.subquery(f"half_{n}").c.id) for n, half in enumerate((by_name, by_sha))]
        either = union(*halves).subquery("either")
        page_ids = select(either.c.id).order_by(either.c.id.desc()).limit(limit)
    return select(Build).where(Build.id.in_(page_ids)).order_by(Build.id.desc())


def list_builds(
    session: Session,
    filters: HistoryFilter | None = None,
    *,
    limit: int = DEFAULT_LIMIT,
    cursor: str | None = None,
    reader: Reader = EVERYTHING,
) -> Page:
    """A page of builds matching ``filters`` that ``reader`` may read, newest first, continuing after
    ``cursor`` if given.

    Raises :class:`InvalidCursor` or :class:`InvalidLimit` (both :class:`HistoryError`, a ValueError).
    Builds added while a client pages never shift the pages it has not read yet; new builds appear
    only on a fresh first page.
    """
    _check_limit(limit)
    before_id = decode_cursor(cursor) if cursor is not None else None
    stmt = list_statement(filters or HistoryFilter(), limit=limit + 1, before_id=before_id, reader=reader)
    rows = list(session.scalars(stmt))
    if len(rows) <= limit:
        return Page(items=rows, next_cursor=None)
    items = rows[:limit]
    return Page(items=items, next_cursor=encode_cursor(items[-1].id))


def count_by_state(session: Session, *, cap: int = 1000, states: Sequence[str] = BUILD_STATES,
                   reader: Reader = EVERYTHING) -> dict[str, StateCount]:
    """How many builds are in each state, counting at most ``cap + 1`` per state, in one query.

    Each count is an index-only walk of ``ix_builds_state_id`` stopped after ``cap + 1`` entries, so the
    cost is bounded by ``cap`` whatever the table size: exact counts of every state would be a scan of the
    whole index on every page view. A state with more than ``cap`` builds comes back as ``(cap, False)``.
    """
    if cap < 1:
        raise ValueError("cap must be at least 1")
    if not states:
        return {}
    parts = []
    for state in states:
        capped = select(Build.id).where(Build.state == state, *build_conditions(reader)).limit(cap + 1).subquery()
        parts.append(select(literal(state).label("state"), func.count().label("n")).select_from(capped))
    counts = {row.state: int(row.n) for row in session.execute(union_all(*parts))}
    return {state: StateCount(min(counts.get(state, 0), cap), counts.get(state, 0) <= cap) for state in states}


def get_build_detail(session: Session, build_id: int, *, event_limit: int = DETAIL_EVENT_LIMIT,
                     reader: Reader = EVERYTHING) -> BuildDetail | None:
    """The build with its artifact, bucket compiles and recent events, or None if there is no such build.

    Three queries whatever the number of buckets or events (one when the build does not exist): build and
    artifact together, the buckets by position, the events of build and artifact.
    """
    if event_limit < 1:
        raise ValueError("event_limit must be at least 1")
    row = session.execute(
        select(Build, Artifact).join(Artifact, Artifact.id == Build.artifact_id)
        .where(Build.id == build_id, *build_conditions(reader))
    ).one_or_none()
    if row is None:
        return None
    build, artifact = row
    buckets = list(
        session.scalars(
            select(BucketCompile)
            .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
            .where(ArtifactBucket.artifact_id == artifact.id)
            .order_by(ArtifactBucket.position, BucketCompile.id)
        )
    )
    # Both halves are prefixes of ix_events_entity_entity_id_id; a build and an artifact have a handful
    # of transitions each, so the OR (a BitmapOr on Postgres) plus a sort stays small.
    newest_events = list(
        session.scalars(
            select(Event)
            .where(
                or_(
                    and_(Event.entity == "build", Event.entity_id == build.id),
                    and_(Event.entity == "artifact", Event.entity_id == artifact.id),
                )
            )
            .order_by(Event.id.desc())
            .limit(event_limit)
        )
    )
    newest_events.reverse()
    return BuildDetail(build=build, artifact=artifact, buckets=buckets, events=newest_events)


@dataclass(frozen=True)
class FailureSummary:
    """Why a set failed, in a line: its first failed bucket (by position) and that compile's last error."""

    position: int
    error_class: str | None
    error_code: str | None
    error_message: str | None


def failure_of_artifacts(session: Session, artifact_ids: Sequence[int]) -> dict[int, FailureSummary]:
    """The first failed bucket of each of these artifacts (a history page's failed builds), in one query."""
    if not artifact_ids:
        return {}
    rows = session.execute(
        select(ArtifactBucket.artifact_id, ArtifactBucket.position, BucketCompile.error_class,
               BucketCompile.error_code, BucketCompile.error_message)
        .join(BucketCompile, BucketCompile.id == ArtifactBucket.bucket_compile_id)
        .where(ArtifactBucket.artifact_id.in_(sorted(set(artifact_ids))), BucketCompile.state == BucketState.FAILED)
        .order_by(ArtifactBucket.artifact_id, ArtifactBucket.position)
    ).all()
    found: dict[int, FailureSummary] = {}
    for artifact_id, position, error_class, error_code, error_message in rows:
        found.setdefault(artifact_id, FailureSummary(position, error_class, error_code, error_message))
    return found
