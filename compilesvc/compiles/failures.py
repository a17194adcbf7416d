"""The failure history of bucket compiles: every failed step, in order, with its class, code and phase.

A compile's own ``error_*`` columns say why it *ended*; the history says how it got there: a store outage
during publish that was retried, a lost dispatch the reconciler re-sent, three attempts that each failed
their own way. Readers show it first cause first (the last error is often a consequence of the first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, insert, select
from sqlalchemy.orm import Session

from compilesvc.ledger.models import BucketCompile, BucketFailure, utcnow
from compilesvc.states import ErrorClass

#: Longest failure message kept anywhere: a failure's history here, the compile's ``error_message``, the
#: compile child's result.json (:mod:`workers.compiling.contract` imports it). Room for a compiler's error after
#: the traceback or command line printed before it; the full text is in the archived compile log.
MAX_MESSAGE = 4000
#: What stands for the middle of a message cut to :data:`MAX_MESSAGE`.
CUT_MARK = " … "


def shorten(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` at most ``limit`` characters long: when it must be cut, its head and its tail around
    :data:`CUT_MARK`. The tail gets two thirds: a compiler's actual error, or an exception's message after
    its traceback, is usually at the end, while the head names what failed."""
    if len(text) <= limit:
        return text
    room = limit - len(CUT_MARK)
    if room < 3:  # no room for both ends: a plain cut
        return text[:limit]
    head = room // 3
    return text[:head] + CUT_MARK + text[len(text) - (room - head):]

_INSERT = insert(cast(Table, BucketFailure.__table__))


class Phase:
    """Where in a compile's life a step failed."""

    DISPATCH = "dispatch"  # the message was lost from the broker (re-sent by the reconciler)
    FETCH = "fetch"  # fetching the pinned model
    COMPILE = "compile"  # the compiler itself
    PUBLISH = "publish"  # storing the outputs and the manifest
    LEASE = "lease"  # the worker stopped renewing its lease (taken back by the reaper)
    WORKER = "worker"  # the worker itself failed unexpectedly (a bug, an unexpected library error)


@dataclass(frozen=True)
class ArchivedLog:
    """A failed attempt's whole compile log, stored as a content-addressed blob by the worker."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Failure:
    attempt: int
    at: datetime
    phase: str
    error_class: str
    code: str | None
    message: str | None
    retry: bool
    log: ArchivedLog | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "at": self.at, "phase": self.phase, "error_class": self.error_class,
                "code": self.code, "message": self.message, "retried": self.retry,
                "log_sha256": self.log.sha256 if self.log else None, "log_size": self.log.size if self.log else None}


def record(session: Session, bucket_compile_id: int, attempt: int, phase: str, error_class: ErrorClass | str,
           code: str | None, message: str | None, *, retry: bool, log: ArchivedLog | None = None) -> None:
    """Add a failure to the history, in the current transaction."""
    # The round is read from the compile in the same statement: every caller records under the row lock
    # that also decides the round.
    round_now = (select(BucketCompile.attempt_round).where(BucketCompile.id == bucket_compile_id)
                 .scalar_subquery())
    session.execute(_INSERT.values(attempt_round=round_now), {
        "bucket_compile_id": bucket_compile_id, "attempt": attempt, "at": utcnow(), "phase": phase,
        "error_class": str(ErrorClass(error_class)), "code": code,
        "message": None if message is None else shorten(message), "retry": retry,
        "log_sha256": log.sha256 if log else None, "log_size": log.size if log else None,
    })


def latest_before(session: Session, bucket_compile_id: int, *, attempt: int, attempt_round: int) -> Failure | None:
    """The most recent failure of a compile's attempts before ``attempt`` in its round of attempts, or None
    (attempts a draining worker handed back left none)."""
    row = session.scalars(select(BucketFailure)
                          .where(BucketFailure.bucket_compile_id == bucket_compile_id,
                                 BucketFailure.attempt < attempt, BucketFailure.attempt_round == attempt_round)
                          .order_by(BucketFailure.id.desc()).limit(1)).one_or_none()
    return None if row is None else _failure(row)


def of_buckets(session: Session, bucket_compile_ids: Iterable[int]) -> dict[int, list[Failure]]:
    """Each compile's failures, oldest (the first cause) first."""
    ids = list(bucket_compile_ids)
    history: dict[int, list[Failure]] = {i: [] for i in ids}
    if not ids:
        return history
    rows = session.scalars(select(BucketFailure).where(BucketFailure.bucket_compile_id.in_(ids))
                           .order_by(BucketFailure.bucket_compile_id, BucketFailure.id))
    for row in rows:
        history[row.bucket_compile_id].append(_failure(row))
    return history


def _failure(row: BucketFailure) -> Failure:
    return Failure(attempt=row.attempt, at=row.at, phase=row.phase, error_class=row.error_class, code=row.code,
                   message=row.message, retry=row.retry,
                   log=ArchivedLog(row.log_sha256, row.log_size or 0) if row.log_sha256 else None)
