"""Central compile logs: lines appended by workers in batches, read by build in id order.

Every line is a ``log_lines`` row tied to a bucket compile and its attempt. A build's log is the lines of
the bucket compiles of its artifact; ``after`` is the last line id a reader has seen, so polling and
Server-Sent Events resume exactly where they left off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from compilesvc.ledger.models import ArtifactBucket, BucketCompile, Build, LogLine, utcnow

MAX_LINE_CHARS = 8192


@dataclass(frozen=True)
class LogEntry:
    id: int
    bucket_key: str
    attempt: int
    at: datetime
    stream: str
    line: str


def append_lines(session: Session, bucket_compile_id: int, attempt: int, lines: Sequence[str],
                 stream: str = "compiler") -> None:
    """Add lines in one multi-row INSERT (workers batch them; a compile can print thousands)."""
    if not lines:
        return
    now = utcnow()
    session.execute(insert(LogLine), [
        {"bucket_compile_id": bucket_compile_id, "attempt": attempt, "at": now, "stream": stream,
         "line": line[:MAX_LINE_CHARS]}
        for line in lines
    ])


def read_build_logs(session: Session, build_id: int, after: int = 0, limit: int = 1000) -> list[LogEntry]:
    """Lines of a build's bucket compiles with id > ``after``, oldest first."""
    artifact_id = select(Build.artifact_id).where(Build.id == build_id).scalar_subquery()
    rows = session.execute(
        select(LogLine.id, BucketCompile.key, LogLine.attempt, LogLine.at, LogLine.stream, LogLine.line)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == LogLine.bucket_compile_id)
        .join(BucketCompile, BucketCompile.id == LogLine.bucket_compile_id)
        .where(ArtifactBucket.artifact_id == artifact_id, LogLine.id > after)
        .order_by(LogLine.id)
        .limit(limit)
    ).all()
    return [LogEntry(*row) for row in rows]


def tail_after(session: Session, build_id: int, lines: int) -> int:
    """The ``after`` from which :func:`read_build_logs` returns a build's last ``lines`` lines (0 when it has
    fewer): a page opens on the tail of a long compile log instead of reading it all."""
    artifact_id = select(Build.artifact_id).where(Build.id == build_id).scalar_subquery()
    found = session.scalar(
        select(LogLine.id)
        .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == LogLine.bucket_compile_id)
        .where(ArtifactBucket.artifact_id == artifact_id)
        .order_by(LogLine.id.desc())
        .offset(lines)
        .limit(1)
    )
    return found or 0


def bucket_tail(session: Session, bucket_compile_id: int, attempt: int, limit: int, *,
                after: datetime | None = None, until: datetime | None = None, stream: str = "compiler") -> list[str]:
    """The last ``limit`` lines one attempt of a compile printed on ``stream`` (between ``after`` and
    ``until`` when given: attempt numbers start again at a retry), oldest first: a failure's compiler
    output, beside the message that was kept."""
    conditions = [LogLine.bucket_compile_id == bucket_compile_id, LogLine.attempt == attempt, LogLine.stream == stream]
    if after is not None:
        conditions.append(LogLine.at > after)
    if until is not None:
        conditions.append(LogLine.at <= until)
    rows = session.scalars(select(LogLine.line).where(*conditions).order_by(LogLine.id.desc()).limit(limit)).all()
    return list(reversed(rows))
