"""The artifacts an engineer browses: newest first, filtered by model, target, SDK or state, each with the
model name its builds gave, its bucket count, size, fetches and whether a retention pin holds it.

Pages are keyset-paginated on the artifact id (``before``), like the build history. Per-row facts (the
model name, the bucket count, the pin, the newest build) are correlated subqueries over indexed columns
(``ix_builds_artifact_id_id`` walks an artifact's builds newest first), run for the page's rows only. A
model filter collects the model's artifact ids from two indexes (artifacts by sha256, builds by name)
first: its cost grows with that model's builds, not with the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, func, select, union
from sqlalchemy.orm import Session

from compilesvc.access.team_reads import EVERYTHING, Reader, artifact_conditions, build_conditions
from compilesvc.insights.history import ListingFilter
from compilesvc.ledger.models import Artifact, ArtifactBucket, Build
from compilesvc.lifecycle.retention import pinned
from compilesvc.states import ArtifactState

__all__ = ["ArtifactFilter", "ArtifactPage", "ArtifactRow", "list_artifacts"]


class ArtifactFilter(ListingFilter):
    """Which artifacts to list (:class:`compilesvc.insights.history.ListingFilter`, and the artifact's state).
    ``model`` is a model name a build gave it, or the model's sha256."""

    state: ArtifactState | None = None


@dataclass(frozen=True)
class ArtifactRow:
    id: int
    key: str
    state: str
    target: str
    sdk: str
    backend: str
    model_sha256: str
    model_name: str | None
    buckets: int
    size_bytes: int | None
    created_at: datetime
    published_at: datetime | None
    fetch_count: int
    last_fetched_at: datetime | None
    pinned: bool
    newest_build_id: int | None


@dataclass(frozen=True)
class ArtifactPage:
    items: list[ArtifactRow]
    next_before: int | None  # pass as ``before`` for the next page; None on the last


def list_artifacts(session: Session, filters: ArtifactFilter, *, limit: int = 50,
                   before: int | None = None, reader: Reader = EVERYTHING) -> ArtifactPage:
    """A page of the artifacts ``reader`` may read, newest first, below the id ``before``; the name and the
    newest build are of the reader's builds (:mod:`compilesvc.access.team_reads`)."""
    own = build_conditions(reader)
    model_name = (select(Build.model_name).where(Build.artifact_id == Artifact.id, Build.model_name.is_not(None),
                                                 *own)
                  .order_by(Build.id.desc()).limit(1).scalar_subquery())
    newest_build = (select(Build.id).where(Build.artifact_id == Artifact.id, *own)
                    .order_by(Build.id.desc()).limit(1).scalar_subquery())
    buckets = (select(func.count()).select_from(ArtifactBucket).where(ArtifactBucket.artifact_id == Artifact.id)
               .scalar_subquery())
    query = select(Artifact, model_name.label("model_name"), buckets.label("buckets"),
                   pinned().label("pinned"), newest_build.label("newest_build"))
    conditions: list[ColumnElement[bool]] = artifact_conditions(reader)
    if filters.model is not None:
        # Two index walks (artifacts by sha256, builds by model name), not a test of every artifact.
        ids = union(select(Artifact.id).where(Artifact.model_sha256 == filters.model),
                    select(Build.artifact_id).where(Build.model_name == filters.model))
        conditions.append(Artifact.id.in_(select(ids.subquery().c.id)))
    for column in ("target", "sdk", "state"):
        value = getattr(filters, column)
        if value is not None:
            conditions.append(getattr(Artifact, column) == value)
    if before is not None:
        conditions.append(Artifact.id < before)
    rows = session.execute(query.where(*conditions).order_by(Artifact.id.desc()).limit(limit + 1)).all()
    items = [ArtifactRow(
        id=artifact.id, key=artifact.key, state=artifact.state, target=artifact.target, sdk=artifact.sdk,
        backend=artifact.backend, model_sha256=artifact.model_sha256, model_name=name, buckets=int(count),
        size_bytes=artifact.size_bytes, created_at=artifact.created_at, published_at=artifact.published_at,
        fetch_count=artifact.fetch_count, last_fetched_at=artifact.last_fetched_at, pinned=bool(is_pinned),
        newest_build_id=build_id,
    ) for artifact, name, count, is_pinned, build_id in rows[:limit]]
    return ArtifactPage(items, items[-1].id if len(rows) > limit else None)
