"""Ledger tables of campaigns: an operator's roll-forward of many artifacts from one SDK release to
another, and one item per artifact it moves (:mod:`compilesvc.lifecycle.campaigns` owns the behaviour);
standing roll-forward policies, the SDK releases workers have registered with, and each policy's run per
release (:mod:`compilesvc.lifecycle.policies`).

Registered on the same metadata as :mod:`compilesvc.ledger.models` (which imports this module last), so
migrations and tests see every table.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint, false, text
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
    policy_id: Mapped[int | None] = mapped_column(ForeignKey("rollforward_policies.id", ondelete="SET NULL"),
                                                  doc="The standing policy that started it; none: an operator.")
    queue_anyway: Mapped[bool] = mapped_column(
        default=False, server_default=false(),
        doc="Its submits queue even while no worker serves to_sdk (the operator's choice; a policy's always do): "
            "a relay resuming it (compilesvc/lifecycle/resume.py) submits as the starter did.")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    __table_args__ = (
        Index("ix_campaigns_state", "state"),
        # One campaign per policy run, whoever starts it (a relay after a worker that died: migration 0020).
        Index("uq_campaigns_policy_id_to_sdk", "policy_id", "to_sdk", unique=True,
              postgresql_where=text("policy_id IS NOT NULL"), sqlite_where=text("policy_id IS NOT NULL")),
        check_constraint("state", CampaignState, "state"),
    )


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
    submit_claimed_at: Mapped[datetime | None] = mapped_column(
        doc="When a starter or relay claimed this item's submit (a conditional update: one of them submits it).")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        UniqueConstraint("campaign_id", "source_key"),
        Index("ix_campaign_items_build_id", "build_id"),
    )


class RollforwardPolicy(Base):
    """A standing roll-forward: when the first worker of a new SDK release registers for a target the policy
    covers, a campaign moves the selected artifacts to that release (:mod:`compilesvc.lifecycle.policies`)."""

    __tablename__ = "rollforward_policies"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    target: Mapped[str | None] = mapped_column(String(16), doc="Only this target's releases and artifacts.")
    from_sdk: Mapped[str | None] = mapped_column(
        String(32), doc="The release moved from; none: the newest older release with published artifacts.")
    model: Mapped[str | None] = mapped_column(String(255))
    labels: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    pinned: Mapped[bool] = mapped_column(default=False)
    fetched_within_days: Mapped[float | None]
    enabled: Mapped[bool] = mapped_column(default=True)
    created_by: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SdkRelease(Base):
    """A (target, SDK release) some worker registered with, and the first worker that did: what makes a
    release new to the fleet. Taken with an insert that ignores conflicts, so one registration is first."""

    __tablename__ = "sdk_releases"

    target: Mapped[str] = mapped_column(String(16), primary_key=True)
    sdk: Mapped[str] = mapped_column(String(32), primary_key=True)
    first_worker_id: Mapped[str] = mapped_column(String(255))
    first_seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class PolicyRun(Base):
    """A policy fired for a release: at most one per (policy, release), the claim that makes it once only."""

    __tablename__ = "rollforward_policy_runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("rollforward_policies.id", ondelete="CASCADE"))
    to_sdk: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(16), doc="The target whose first worker of to_sdk fired it.")
    worker_id: Mapped[str] = mapped_column(String(255))
    from_sdk: Mapped[str | None] = mapped_column(String(32))
    campaign_id: Mapped[int | None] = mapped_column(ForeignKey("campaigns.id", ondelete="SET NULL"))
    note: Mapped[str | None] = mapped_column(Text, doc="Why no campaign started (no source release, a failure).")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("policy_id", "to_sdk"), Index("ix_rollforward_policy_runs_campaign_id",
                                                                      "campaign_id"))
