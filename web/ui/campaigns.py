"""The campaigns page: roll-forward campaigns (an operator's or a standing policy's) with their progress,
and the standing roll-forward policies with the releases they fired for (:mod:`compilesvc.lifecycle.policies`)."""

from __future__ import annotations

from typing import Any

from flask import render_template
from sqlalchemy import select

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission
from compilesvc.ledger.campaigns import Campaign, RollforwardPolicy
from compilesvc.lifecycle import campaigns as campaign_progress
from compilesvc.lifecycle import policies
from web import readers
from web.context import web
from web.contract.access import access
from web.ui import bp

SHOWN = 50


@bp.get("/campaigns")
@access(Permission.READ)
def campaigns_page() -> str:
    ctx = web()
    rows: list[dict[str, Any]] = []
    policy_rows: list[dict[str, Any]] = []
    shown = team_reads.may_read_campaigns(readers.reader())
    if shown:
        with ctx.services.sessions() as session:
            names = {row.id: row.name for row in session.execute(select(RollforwardPolicy.id, RollforwardPolicy.name))}
            for campaign in session.scalars(select(Campaign).order_by(Campaign.id.desc()).limit(SHOWN)):
                rows.append({"campaign": campaign, "progress": campaign_progress.progress(session, campaign),
                             "policy": names.get(campaign.policy_id) if campaign.policy_id else None})
            for policy in session.scalars(select(RollforwardPolicy).order_by(RollforwardPolicy.id)):
                policy_rows.append({"policy": policy, "runs": policies.runs_of(session, policy.id)})
    return render_template("campaigns.html", rows=rows, policies=policy_rows, shown=shown)
