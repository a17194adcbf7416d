"""Ledger tables of retention: what must be kept whatever the policy says (pins), and every garbage
collection with what it deleted (:mod:`compilesvc.lifecycle.retention` owns the behaviour).

Registered on the same metadata as :mod:`compilesvc.ledger.models`, which imports this module last.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from compilesvc.ledger.models import Base, BigId, Json, check_constraint, utcnow
from compilesvc.states import PinKind


class RetentionPin(Base):
    """Keep every artifact this matches: one artifact (by key), every artifact of a model name, or every
    artifact with a build carrying a label (``name:value``)."""

    __tablename__ = "retention_pins"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    value: Mapped[str] = mapped_column(String(1100))
    note: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("kind", "value"), check_constraint("kind", PinKind, "kind"))


class GcRun(Base):
    """One ``compilesvc gc`` (or its dry run): the policy it applied and what it removed."""

    __tablename__ = "gc_runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    dry_run: Mapped[bool] = mapped_column(Boolean)
    started_by: Mapped[str | None] = mapped_column(String(255))
    policy: Mapped[dict[str, Any]] = mapped_column(Json)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    artifacts: Mapped[int] = mapped_column(Integer, default=0, doc="Artifacts marked deleted.")
    documents: Mapped[int] = mapped_column(Integer, default=0, doc="Manifests removed from the store.")
    blobs: Mapped[int] = mapped_column(Integer, default=0, doc="Blobs removed from the store.")
    bytes_freed: Mapped[int] = mapped_column(BigInteger, default=0)


class GcDeletion(Base):
    """One thing a run deleted (or, in a dry run, would delete), and why."""

    __tablename__ = "gc_deletions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("gc_runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16), doc="artifact | bucket | document | blob")
    name: Mapped[str] = mapped_column(String(1024), doc="Artifact or bucket key, document name, blob sha256.")
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(String(255))

    __table_args__ = (Index("ix_gc_deletions_run_id", "run_id"),)
