"""Ledger tables of campaigns: an operator's roll-forward of many artifacts from one SDK release to
another, and one item per artifact it moves (:mod:`compilesvc.lifecycle.campaigns` owns the behaviour).

Registered on the same metadata as :mod:`compilesvc.ledger.models` (which imports this module last), so
migrations and tests see every table.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from compilesvc.ledger.models import Base, BigId, Json, check_constraint, utcnow
from compilesvc.states import CampaignState


class Campaign(Base):
    """A roll-forward: every selected artifact of ``from_sdk`` submitted again for ``to_sdk``."""

    __tablename__ = "campaigns"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), doc="rollforward")
    from_sdk: Mapped[str] = mapped_column(String(32))
    to_sdk: Mapped[str] = mapped_column(String(32))
    selection: Mapped[dict[str, Any]] = mapped_column(Json, doc="The filters that chose the artifacts.")
    state: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str | None] = mapped_column(String(255))
    team: Mapped[str | None] = mapped_column(String(255))
    token_id: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_campaigns_state", "state"), check_constraint("state", CampaignState, "state"))


class CampaignItem(Base):
    """One artifact a campaign moves: the build whose spec it took, and the build it submitted (or why the
    submit was refused)."""

    __tablename__ = "campaign_items"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(ForeignKey("campaigns.id", ondelete="CASCADE"))
    source_key: Mapped[str] = mapped_column(String(64), doc="The artifact rolled forward.")
    source_build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"), doc="Whose spec was resubmitted.")
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id"), doc="The submit for the new release.")
    refusal: Mapped[str | None] = mapped_column(Text, doc="Why the new release's submit was refused.")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        UniqueConstraint("campaign_id", "source_key"),
        Index("ix_campaign_items_build_id", "build_id"),
    )
