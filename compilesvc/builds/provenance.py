"""Where each bucket of a build came from: compiled for it, joined while another build compiled it, reused
from an earlier build's compile, a failure remembered from an earlier build, imported from the store, or
not compiled at all (its set had failed or was cancelled first).

A bucket compile is shared by every set that contains its key, so its log, worker and timings belong to
the build that made it compile, not to each build that later reuses it. Three records keep this straight:

- ``bucket_compiles.origin_build_id``: the build whose submit (or retry) last queued the compile (and
  ``model_name``, that build's, which the statistics group compile times by);
- ``builds.provenance``: what each bucket was *for this build* when it was submitted, as
  ``{"<bucket compile id>": {"how": ..., "from_build": id | null}}``;
- ``builds.buckets_reused`` and ``buckets_compiled``: how many it found compiled already and how many it
  compiled itself (:func:`cache_outcome` and the statistics classify builds by them).

All are written in the submit's transaction. A cache hit reuses every bucket by definition, so the hit
fast path writes only the counts (no provenance, no extra query); :func:`origins` derives it when read.
A retry turns the buckets it requeues into compiles of the retried build (:func:`mark_compiled`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from sqlalchemy import update
from sqlalchemy.orm import Session

from compilesvc.ledger.models import BucketCompile, Build
from compilesvc.states import BucketState, Outcome, failed_for_good

__all__ = ["How", "Origin", "at_submit", "cache_outcome", "counts", "mark_compiled", "origins", "record_origin"]


class How(StrEnum):
    COMPILED = "compiled"  # this build queued it (its log, worker and timings are this build's)
    JOINED = "joined"  # another build's compile was queued or running: this build waited for it
    REUSED = "reused"  # compiled before this build was submitted
    FAILED = "failed"  # failed for good before this build was submitted (the negative cache)
    IMPORTED = "imported"  # its manifest was found in the store: compiled by another ledger
    NOT_COMPILED = "not-compiled"  # cancelled, deleted or failed, and not queued again: its set had failed
    UNRECORDED = "unrecorded"  # submitted before provenance was recorded (migration 0013)


#: The ways a build gets a bucket without compiling it, which count as reuse.
REUSE = frozenset({How.REUSED, How.IMPORTED})


@dataclass(frozen=True)
class Origin:
    """One bucket of a build: how the build got it, from which build when not its own compile, and the
    later build that compiled it again (a retry or a resubmit after retention) when there is one."""

    how: How
    from_build: int | None
    again_by: int | None = None


class _Compile(Protocol):
    @property
    def id(self) -> int | None: ...

    @property
    def state(self) -> str: ...

    @property
    def error_class(self) -> str | None: ...

    @property
    def started_at(self) -> datetime | None: ...

    @property
    def origin_build_id(self) -> int | None: ...


def _how(bucket: _Compile, queued_now: set[int]) -> How:
    if bucket.id in queued_now:
        return How.COMPILED
    if bucket.state == BucketState.SUCCEEDED:
        return How.IMPORTED if bucket.started_at is None else How.REUSED  # an import never ran here
    if failed_for_good(bucket.state, bucket.error_class):
        return How.FAILED
    if bucket.state in (BucketState.QUEUED, BucketState.RUNNING):
        return How.JOINED
    return How.NOT_COMPILED


def at_submit(buckets: Iterable[_Compile], queued_now: set[int]) -> dict[str, dict[str, Any]]:
    """The provenance a submit records for its build: ``buckets`` as they are at the end of its
    transaction, ``queued_now`` the ids it queued (created or requeued) for this build."""
    recorded: dict[str, dict[str, Any]] = {}
    for bucket in buckets:
        how = _how(bucket, queued_now)
        from_build = None if how in (How.COMPILED, How.IMPORTED) else bucket.origin_build_id
        recorded[str(bucket.id)] = {"how": str(how), "from_build": from_build}
    return recorded


def counts(provenance: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(buckets reused, buckets compiled by the build) of a recorded provenance."""
    hows = [entry["how"] for entry in provenance.values()]
    return sum(1 for how in hows if how in REUSE), sum(1 for how in hows if how == How.COMPILED)


def cache_outcome(outcome: str, provenance: dict[str, dict[str, Any]] | None) -> str:
    """What the cache did for a build, in words: hit, joined, joined a remembered failure, reused every
    bucket, partly reused (k of n), built. From what it recorded, not from ``outcome`` alone: a resubmit
    that reopened a cancelled set is a join that compiled everything, and a new set can reuse all of it."""
    if outcome == Outcome.HIT:
        return "hit"
    if provenance is None:  # submitted before provenance was recorded
        return "joined" if outcome == Outcome.JOIN else "built"
    reused, compiled = counts(provenance)
    total = len(provenance)
    if compiled == 0:
        if any(entry["how"] == How.FAILED for entry in provenance.values()):
            return "joined a remembered failure"
        return "reused every bucket" if reused == total else "joined"
    return f"partly reused ({reused} of {total})" if reused else "built"


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
    build.buckets_reused, build.buckets_compiled = counts(provenance)


def origins(build: Build, buckets: Iterable[_Compile]) -> dict[int, Origin]:
    """Each bucket's origin for ``build``, by bucket compile id.

    A cache hit records no provenance: it reused every bucket from whichever build compiled it before the
    hit (a later build that compiled the key again, after retention deleted it, is not where the hit's
    files came from). A compile this build made and a later build made again says so (``again_by``)."""
    recorded = build.provenance or {}
    found: dict[int, Origin] = {}
    for bucket in buckets:
        if bucket.id is None:
            continue
        origin = bucket.origin_build_id
        earlier = origin if origin is not None and origin < build.id else None
        later = origin if origin is not None and origin > build.id else None
        entry = recorded.get(str(bucket.id))
        if entry is not None:
            how = How(entry["how"])
            found[bucket.id] = Origin(how, entry.get("from_build"), later if how == How.COMPILED else None)
        elif origin == build.id:
            found[bucket.id] = Origin(How.COMPILED, None)
        elif build.outcome == Outcome.HIT:
            how = How.IMPORTED if bucket.started_at is None else How.REUSED
            found[bucket.id] = Origin(how, earlier)
        else:
            found[bucket.id] = Origin(How.UNRECORDED, earlier)
    return found
