"""Where each bucket of a build came from: compiled for it, joined while another build compiled it, reused
from an earlier build's compile, a failure remembered from an earlier build, or imported from the store.

A bucket compile is shared by every set that contains its key, so its log, worker and timings belong to
the build that made it compile, not to each build that later reuses it. Two records keep this straight:

- ``bucket_compiles.origin_build_id``: the build whose submit (or retry) last queued the compile (and
  ``model_name``, that build's, which the statistics group compile times by);
- ``builds.provenance``: what each bucket was *for this build* when it was submitted, as
  ``{"<bucket compile id>": {"how": ..., "from_build": id | null}}``, and ``builds.buckets_reused``, how
  many it found compiled already (the history's "partly reused" and the statistics' saved compiles).

Both are written in the submit's transaction. A cache hit reuses every bucket by definition, so the hit
fast path writes only the count (no provenance, no extra query); :func:`origins` derives it when read.
A retry turns the buckets it requeues into compiles of the retried build (:func:`mark_compiled`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from sqlalchemy import update
from sqlalchemy.orm import Session

from compilesvc.ledger.models import BucketCompile, Build
from compilesvc.states import NEGATIVELY_CACHED, BucketState, Outcome

__all__ = ["How", "Origin", "at_submit", "mark_compiled", "origins", "record_origin", "reused_count"]


class How(StrEnum):
    COMPILED = "compiled"  # this build queued it (its log, worker and timings are this build's)
    JOINED = "joined"  # another build's compile was queued or running: this build waited for it
    REUSED = "reused"  # compiled before this build was submitted
    FAILED = "failed"  # failed for good before this build was submitted (the negative cache)
    IMPORTED = "imported"  # its manifest was found in the store: compiled by another ledger
    UNRECORDED = "unrecorded"  # submitted before provenance was recorded (migration 0013)


@dataclass(frozen=True)
class Origin:
    """One bucket of a build: how the build got it, and from which build when not its own compile."""

    how: How
    from_build: int | None

    @property
    def own(self) -> bool:
        return self.how == How.COMPILED


def _how(bucket: BucketCompile, queued_now: set[int]) -> How:
    if bucket.id in queued_now:
        return How.COMPILED
    if bucket.state == BucketState.SUCCEEDED:
        return How.REUSED if bucket.origin_build_id is not None else How.IMPORTED
    if bucket.state == BucketState.FAILED and bucket.error_class in NEGATIVELY_CACHED:
        return How.FAILED
    return How.JOINED


def at_submit(buckets: Iterable[BucketCompile], queued_now: set[int]) -> dict[str, dict[str, Any]]:
    """The provenance a submit records for its build: ``buckets`` as they are at the end of its
    transaction, ``queued_now`` the ids it queued (created or requeued) for this build."""
    recorded: dict[str, dict[str, Any]] = {}
    for bucket in buckets:
        how = _how(bucket, queued_now)
        recorded[str(bucket.id)] = {"how": str(how),
                                    "from_build": None if how == How.COMPILED else bucket.origin_build_id}
    return recorded


def reused_count(provenance: dict[str, dict[str, Any]]) -> int:
    return sum(1 for entry in provenance.values() if entry["how"] in (How.REUSED, How.IMPORTED))


def record_origin(session: Session, build_id: int, model_name: str | None, bucket_ids: Sequence[int]) -> None:
    """Make ``build_id`` (of the model named ``model_name``) the origin of the compiles it just queued, in its
    submit's or retry's transaction."""
    if bucket_ids:
        session.execute(update(BucketCompile).where(BucketCompile.id.in_(bucket_ids))
                        .values(origin_build_id=build_id, model_name=model_name)
                        .execution_options(synchronize_session=False))


def mark_compiled(session: Session, build: Build, bucket_ids: Sequence[int]) -> None:
    """A retry of ``build`` requeued ``bucket_ids``: they are its own compiles from now on."""
    record_origin(session, build.id, build.model_name, bucket_ids)
    if build.provenance is None:
        return
    provenance = {key: dict(entry) for key, entry in build.provenance.items()}
    for bucket_id in bucket_ids:
        provenance[str(bucket_id)] = {"how": str(How.COMPILED), "from_build": None}
    build.provenance = provenance  # a new object: JSON columns track assignment, not mutation
    build.buckets_reused = reused_count(provenance)


class _Compile(Protocol):
    @property
    def id(self) -> int | None: ...

    @property
    def origin_build_id(self) -> int | None: ...


def origins(build: Build, buckets: Iterable[_Compile]) -> dict[int, Origin]:
    """Each bucket's origin for ``build``, by bucket compile id. A cache hit records no provenance: it reused
    every bucket from whichever build compiled it (or imported it, when no build of this ledger did)."""
    recorded = build.provenance or {}
    hit = build.outcome == Outcome.HIT
    found: dict[int, Origin] = {}
    for bucket in buckets:
        if bucket.id is None:
            continue
        entry = recorded.get(str(bucket.id))
        if entry is not None:
            found[bucket.id] = Origin(How(entry["how"]), entry.get("from_build"))
        elif bucket.origin_build_id == build.id:
            found[bucket.id] = Origin(How.COMPILED, None)
        elif hit:
            found[bucket.id] = Origin(How.REUSED if bucket.origin_build_id else How.IMPORTED, bucket.origin_build_id)
        else:
            found[bucket.id] = Origin(How.UNRECORDED, bucket.origin_build_id)
    return found
