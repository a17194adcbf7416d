"""Service statistics for the UI's Stats page: how submits were answered over time, how long compiles take
per model and target, which failures happen, and how long compiles wait in the queue.

Each function reads one window (:func:`window`): ``day`` is 24 hourly bins, ``week`` 7 daily bins, both
aligned to UTC clock boundaries, the last bin being the one ``now`` is in. Every query is bounded by its
window through an index on the time it filters by (``builds.created_at``, ``bucket_compiles.finished_at``
and ``started_at``, ``bucket_failures.at``), so its cost follows the window's activity and not the size of
the ledger; ``python -m bench.history_scale`` times them and checks their plans at a million builds.

The same SQL runs on Postgres and SQLite:

- bins are a ``CASE`` over the bins' bound timestamps, not a dialect's date functions;
- percentiles are nearest-rank (the value at rank ⌈p·n⌉ in ascending order), picked in SQL with
  ``row_number()`` and ``count()`` window functions (SQLite has no ``percentile_cont``), so that only the
  rows at those ranks leave the database. Sending a week's ~10,000 values to sort them here was as fast at
  the median, but the objects they make set off Python's cyclic garbage collector, whose pauses tripled
  the p95 and p99 (measured with ``bench.history_scale``);
- the one dialect difference, a duration between two timestamps in seconds, is :func:`_seconds_between`.

A compile's model name is recorded on it when it is queued (``bucket_compiles.model_name``, the queuing
build's): grouping a week of compiles by it is read from the compiles alone, not one lookup of ``builds``
per compile (which measured ~35-50 ms of Postgres time for ~10,000 compiles and a p99 past 100 ms at a
million builds). Only compiles queued by no named build (imported from the store) look their artifact's
builds up.

On Postgres each read turns JIT compilation off for its transaction (:func:`_without_jit`): the planner
prices a window's per-row primary-key lookups high enough to JIT-compile the statement, which then costs
ten times the query itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Float, Select, and_, case, func, literal, select, text
from sqlalchemy.orm import Session, aliased

from compilesvc.access.team_reads import EVERYTHING, Reader, build_conditions, compile_conditions
from compilesvc.ledger.models import ArtifactBucket, BucketCompile, BucketFailure, Build
from compilesvc.states import BucketState, Outcome

__all__ = [
    "WINDOWS",
    "CompileTimes",
    "FailureCount",
    "OutcomeBin",
    "Percentiles",
    "QueueWait",
    "Stats",
    "UnknownWindow",
    "Window",
    "collect",
    "compile_times",
    "failures",
    "outcomes",
    "queue_wait",
    "window",
]

#: Window name → (bin width, number of bins).
WINDOWS: dict[str, tuple[timedelta, int]] = {"day": (timedelta(hours=1), 24), "week": (timedelta(days=1), 7)}


class UnknownWindow(ValueError):
    """A window name other than those of :data:`WINDOWS`."""


@dataclass(frozen=True)
class Window:
    """``[start, stop)`` in ``count`` bins of ``step``; ``stop`` is the end of the bin ``now`` is in."""

    name: str
    start: datetime
    step: timedelta
    count: int

    @property
    def stop(self) -> datetime:
        return self.start + self.step * self.count

    @property
    def bins(self) -> list[datetime]:
        """Each bin's start."""
        return [self.start + self.step * i for i in range(self.count)]


def window(name: str, now: datetime | None = None) -> Window:
    if name not in WINDOWS:
        raise UnknownWindow(f"window must be one of {', '.join(WINDOWS)}, not {name!r}")
    step, count = WINDOWS[name]
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    midnight = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    current = midnight + (moment - midnight) // step * step
    return Window(name, current - step * (count - 1), step, count)


@dataclass(frozen=True)
class OutcomeBin:
    """Builds submitted in one bin, by how they were answered. ``built`` compiled every bucket; a
    ``partly_reused`` build was new but found some of its buckets compiled already."""

    start: datetime
    hit: int = 0
    joined: int = 0
    built: int = 0
    partly_reused: int = 0

    @property
    def total(self) -> int:
        return self.hit + self.joined + self.built + self.partly_reused


@dataclass(frozen=True)
class Percentiles:
    """Nearest-rank percentiles of ``count`` values, in seconds (None when there are none)."""

    count: int = 0
    p50: float | None = None
    p95: float | None = None


@dataclass(frozen=True)
class CompileTimes:
    """Succeeded compiles that finished in the window, for one model name (None: never named) and target."""

    model_name: str | None
    target: str
    seconds: Percentiles


@dataclass(frozen=True)
class FailureCount:
    """Failed steps of compiles in the window for one error class: retried, or final for that compile."""

    error_class: str
    retried: int
    final: int

    @property
    def total(self) -> int:
        return self.retried + self.final


@dataclass(frozen=True)
class QueueWait:
    """Seconds from queued to started, of compiles started in the window: overall and per bin."""

    overall: Percentiles
    bins: list[tuple[datetime, Percentiles]]


@dataclass(frozen=True)
class Stats:
    window: Window
    outcomes: list[OutcomeBin]
    compile_times: list[CompileTimes]
    failures: list[FailureCount]
    queue_wait: QueueWait


def collect(session: Session, name: str, now: datetime | None = None, *, reader: Reader = EVERYTHING) -> Stats:
    """Everything the Stats page shows for window ``name`` (raises :class:`UnknownWindow`), counting only
    what ``reader`` may read (:mod:`compilesvc.access.team_reads`)."""
    span = window(name, now)
    return Stats(span, outcomes(session, span, reader), compile_times(session, span, reader),
                 failures(session, span, reader), queue_wait(session, span, reader))


def _without_jit(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL jit = off"))


def _bin_of(column: Any, span: Window) -> ColumnElement[int]:
    """The bin index of a timestamp already known to be inside the window."""
    bounds = span.bins[1:]
    if not bounds:
        return literal(0)
    return case(*[(column < bound, index) for index, bound in enumerate(bounds)], else_=len(bounds))


def _inside(column: Any, span: Window) -> ColumnElement[bool]:
    return and_(column >= span.start, column < span.stop)


def outcomes(session: Session, span: Window, reader: Reader = EVERYTHING) -> list[OutcomeBin]:
    """Builds created in the window, per bin and outcome (every bin, empty ones too)."""
    _without_jit(session)
    # What the cache did, as compilesvc.builds.provenance.cache_outcome says it from the build's counts: a build
    # that compiled nothing joined (or reused everything); one that compiled some and reused some partly
    # reused. Builds from before the counts were recorded (NULL) go by their outcome.
    kind = case(
        (Build.outcome == Outcome.HIT, literal("hit")),
        (Build.buckets_compiled == 0, literal("joined")),
        (and_(Build.buckets_compiled.is_(None), Build.outcome == Outcome.JOIN), literal("joined")),
        (Build.buckets_reused > 0, literal("partly_reused")),
        else_=literal("built"),
    )
    rows = session.execute(
        select(_bin_of(Build.created_at, span).label("bin"), kind.label("kind"), func.count())
        .where(_inside(Build.created_at, span), *build_conditions(reader))
        .group_by("bin", "kind")
    ).all()
    counts: list[dict[str, int]] = [{} for _ in range(span.count)]
    for index, name, count in rows:
        counts[index][name] = counts[index].get(name, 0) + count
    return [OutcomeBin(start, **counts[i]) for i, start in enumerate(span.bins)]


def _percentiles(session: Session, source: Select[*tuple[Any, ...]], groups: int) -> list[tuple[Any, ...]]:
    """``(group values…, count, p50, p95)`` per group of ``source``, whose columns are ``groups`` group
    columns and then the value; only the rows at the two ranks are aggregated."""
    inner = source.subquery()
    keys = list(inner.columns)[:groups]
    value = list(inner.columns)[groups]
    ranked = select(
        *keys, value.label("v"),
        func.row_number().over(partition_by=keys, order_by=value).label("rn"),
        func.count().over(partition_by=keys).label("n"),
    ).subquery()
    group_keys = list(ranked.columns)[:groups]
    rank50, rank95 = _rank(ranked.c.n, 50), _rank(ranked.c.n, 95)
    statement = (
        select(*group_keys, func.max(ranked.c.n),
               func.max(case((ranked.c.rn == rank50, ranked.c.v))),
               func.max(case((ranked.c.rn == rank95, ranked.c.v))))
        .where((ranked.c.rn == rank50) | (ranked.c.rn == rank95))
        .group_by(*group_keys)
    )
    return [tuple(row) for row in session.connection().execute(statement).all()]


def _rank(count: Any, percent: int) -> Any:
    """⌈count·percent/100⌉ in integer arithmetic (SQLite has no ceil everywhere, and floats would round)."""
    return (count * percent + 99) // 100


def _as_percentiles(count: int, p50: float | None, p95: float | None) -> Percentiles:
    # Durations come out of SQLite's julianday arithmetic with float noise: milliseconds are plenty.
    return Percentiles(int(count), None if p50 is None else round(float(p50), 3),
                       None if p95 is None else round(float(p95), 3))


def compile_times(session: Session, span: Window, reader: Reader = EVERYTHING) -> list[CompileTimes]:
    """Succeeded compiles finished in the window, per model name and target, slowest p95 first. A compile's
    model name is that of the build that queued it (recorded on the compile), else of the first named build
    of its artifacts (a compile imported from the store, or queued by a build submitted by sha256 alone)."""
    _without_jit(session)
    named = aliased(Build)
    # A correlated lookup, not a join (a join lets the planner hash all of ``builds``), and only where the
    # compile has no name: COALESCE evaluates it lazily.
    fallback = (
        select(named.model_name)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == named.artifact_id)
        .where(ArtifactBucket.bucket_compile_id == BucketCompile.id, named.model_name.is_not(None))
        .order_by(named.id)
        .limit(1)
        .scalar_subquery()
    )
    source = (
        select(func.coalesce(BucketCompile.model_name, fallback).label("model_name"), BucketCompile.target,
               BucketCompile.compile_seconds)
        # started_at: an imported compile ran on another ledger's worker, whenever; it never started here.
        .where(_inside(BucketCompile.finished_at, span), BucketCompile.state == BucketState.SUCCEEDED,
               BucketCompile.compile_seconds.is_not(None), BucketCompile.started_at.is_not(None),
               *compile_conditions(reader, BucketCompile.id))
    )
    found = [CompileTimes(model, target, _as_percentiles(n, p50, p95))
             for model, target, n, p50, p95 in _percentiles(session, source, 2)]
    return sorted(found, key=lambda c: (-(c.seconds.p95 or 0.0), c.model_name or "", c.target))


def failures(session: Session, span: Window, reader: Reader = EVERYTHING) -> list[FailureCount]:
    """Failed steps recorded in the window per error class, most frequent first."""
    _without_jit(session)
    rows = session.execute(
        select(BucketFailure.error_class, BucketFailure.retry, func.count())
        .where(_inside(BucketFailure.at, span), *compile_conditions(reader, BucketFailure.bucket_compile_id))
        .group_by(BucketFailure.error_class, BucketFailure.retry)
    ).all()
    counts: dict[str, list[int]] = {}
    for error_class, retried, count in rows:
        counts.setdefault(error_class, [0, 0])[0 if retried else 1] += count
    found = [FailureCount(name, retried, final) for name, (retried, final) in counts.items()]
    return sorted(found, key=lambda f: (-f.total, f.error_class))


def _seconds_between(session: Session, earlier: Any, later: Any) -> ColumnElement[float]:
    if session.get_bind().dialect.name == "postgresql":
        # date_part is double precision; EXTRACT is numeric, which sorts several times slower.
        return func.date_part("epoch", later - earlier, type_=Float)
    return (func.julianday(later) - func.julianday(earlier)) * 86400.0


def queue_wait(session: Session, span: Window, reader: Reader = EVERYTHING) -> QueueWait:
    """How long compiles started in the window waited after being queued: overall and per bin, ranked in
    one statement (two window orders over the same rows)."""
    _without_jit(session)
    started = (
        select(_bin_of(BucketCompile.started_at, span).label("bin"),
               _seconds_between(session, BucketCompile.queued_at, BucketCompile.started_at).label("wait"))
        # A requeue stamps a new queued_at and leaves the last attempt's started_at: until the compile starts
        # again, the wait of that attempt is unknown, and the compile is not one started in the window.
        .where(_inside(BucketCompile.started_at, span), BucketCompile.started_at >= BucketCompile.queued_at,
               *compile_conditions(reader, BucketCompile.id))
        .subquery()
    )
    ranked = select(
        started.c.bin, started.c.wait,
        func.row_number().over(partition_by=started.c.bin, order_by=started.c.wait).label("rn"),
        func.count().over(partition_by=started.c.bin).label("n"),
        func.row_number().over(order_by=started.c.wait).label("rn_all"),
        func.count().over().label("n_all"),
    ).subquery()
    r = ranked.c
    bin50, bin95, all50, all95 = _rank(r.n, 50), _rank(r.n, 95), _rank(r.n_all, 50), _rank(r.n_all, 95)
    rows = session.connection().execute(
        select(r.bin, func.max(r.n), func.max(case((r.rn == bin50, r.wait))), func.max(case((r.rn == bin95, r.wait))),
               func.max(r.n_all), func.max(case((r.rn_all == all50, r.wait))),
               func.max(case((r.rn_all == all95, r.wait))))
        .where((r.rn == bin50) | (r.rn == bin95) | (r.rn_all == all50) | (r.rn_all == all95))
        .group_by(r.bin)
    ).all()
    per_bin = {row[0]: _as_percentiles(*row[1:4]) for row in rows}
    overall = Percentiles()
    if rows:  # each overall rank is in one bin's row, NULL in the others
        overall = _as_percentiles(rows[0][4], max((row[5] for row in rows if row[5] is not None), default=None),
                                  max((row[6] for row in rows if row[6] is not None), default=None))
    return QueueWait(overall, [(start, per_bin.get(i, Percentiles())) for i, start in enumerate(span.bins)])
