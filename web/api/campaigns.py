"""``/v1/campaigns``: roll-forwards of artifacts to another SDK release (:mod:`compilesvc.lifecycle.campaigns`),
started by an admin, followed by anyone who may read builds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flask import Blueprint, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission
from compilesvc.builds.policy_submits import campaign_submit
from compilesvc.ledger.campaigns import Campaign
from compilesvc.ledger.models import Artifact
from compilesvc.lifecycle import campaigns
from compilesvc.pinning.pins import ModelPinning, ModelRefError
from compilesvc.spec.parsing import SpecError
from web import readers
from web.api.params import model_body, parse_for_service, respond
from web.auth import current_principal
from web.context import WebContext, web
from web.contract.fleet_schemas import CampaignList, CampaignOut, RollforwardIn, RollforwardPlan
from web.contract.inputs import CampaignListQuery
from web.contract.openapi import operation
from web.contract.problems import Problem

bp = Blueprint("campaigns", __name__, url_prefix="/v1/campaigns")


def campaign_json(ctx: WebContext, session: Session, campaign: Campaign) -> dict[str, Any]:
    progress = campaigns.progress(session, campaign)
    counts = {name: getattr(progress, name) for name in
              ("total", "submitted", "building", "built", "hit", "failed", "cancelled", "refused")}
    return {"id": campaign.id, "kind": campaign.kind, "policy_id": campaign.policy_id, "from_sdk": campaign.from_sdk,
            "to_sdk": campaign.to_sdk,
            "selection": campaign.selection, "state": campaign.state, "created_by": campaign.created_by,
            "created_at": campaign.created_at, "finished_at": campaign.finished_at, "progress": counts,
            "failures": progress.failures, "refusals": progress.refusals, "items": progress.items,
            "url": ctx.url(f"/v1/campaigns/{campaign.id}")}


def _plan(ctx: WebContext, selection: campaigns.Selection) -> dict[str, Any]:
    with ctx.services.sessions() as session:
        found = campaigns.candidates(session, selection)
    items = []
    for candidate in found:
        item: dict[str, Any] = {"source_key": candidate.artifact_key, "build_id": candidate.build_id,
                                "model_name": candidate.model_name, "target": candidate.target,
                                "key": None, "state": None, "refusal": None}
        try:
            document = campaigns.rolled_spec(candidate.spec, selection.to_sdk, None)
            _, keys = ctx.submitter.keys_for(parse_for_service(document, ctx.settings), candidate.model,
                                             team=candidate.team)
        except (SpecError, ModelRefError) as exc:
            item["refusal"] = campaigns.refusal_text(exc)
        except ModelPinning:
            item["state"] = "pinning"  # its model is being hashed in the background: the key is not known yet
        else:
            with ctx.services.sessions() as session:
                state = session.scalar(select(Artifact.state).where(Artifact.key == keys.key))
            item.update(key=keys.key, state=state or "absent")
        items.append(item)
    return {"dry_run": True, "from_sdk": selection.from_sdk, "to_sdk": selection.to_sdk, "items": items}


@bp.post("/rollforward")
@operation(summary="Roll artifacts forward to another SDK release", tag="campaigns", access=Permission.ADMIN,
           request=RollforwardIn,
           description="Every published artifact of `from_sdk` (narrowed by `model`, `target`, `labels`) is "
                       "submitted again with `sdk` set to `to_sdk`: the spec of its newest matching build, "
                       "labelled `campaign: <id>`. 201 with the campaign, whose progress counts built, hit, "
                       "failed (with the compiler's error) and refused items; `dry_run` answers 200 with "
                       "what would be submitted and the new keys' states, and submits nothing.",
           responses={201: CampaignOut, 200: RollforwardPlan}, problems=(400, 413, 422))
def rollforward() -> Response:
    asked = model_body(RollforwardIn, "campaign-invalid")
    if asked.from_sdk == asked.to_sdk:
        raise Problem("campaign-invalid", f"from_sdk and to_sdk are both {asked.from_sdk}: nothing would move")
    ctx = web()
    selection = campaigns.Selection(asked.from_sdk, asked.to_sdk, asked.model, asked.target, dict(asked.labels),
                                    asked.pinned, asked.fetched_within_days)
    if asked.dry_run:
        return respond(RollforwardPlan, _plan(ctx, selection))
    principal = current_principal()
    # Recorded with the campaign: the relay resumes it as this request would have, if this worker dies mid-loop.
    submit = campaign_submit(ctx.submitter, principal, queue_anyway=asked.queue_anyway)
    campaign_id = campaigns.start(ctx.services.sessions, selection, submit, principal,
                                  queue_anyway=asked.queue_anyway)
    with ctx.services.sessions() as session:
        body = campaign_json(ctx, session, session.get_one(Campaign, campaign_id))
    return respond(CampaignOut, body, 201, headers={"Location": body["url"]})


@bp.get("")
@operation(summary="Campaigns, newest first", tag="campaigns", access=Permission.READ, query=CampaignListQuery,
           description="Roll-forward campaigns with their SDK releases, selection and progress counts; empty "
                       "for a token that may not read every team's builds.",
           responses={200: CampaignList})
def list_campaigns(query: CampaignListQuery) -> Response:
    ctx = web()
    with ctx.services.sessions() as session:
        shown = team_reads.may_read_campaigns(readers.reader())
        rows: Iterable[Campaign] = (
            session.scalars(select(Campaign).order_by(Campaign.id.desc()).limit(query.limit)) if shown else [])
        return respond(CampaignList, {"items": [campaign_json(ctx, session, row) for row in rows]})


@bp.get("/<ledger_id:campaign_id>")
@operation(summary="A campaign and its progress", tag="campaigns", access=Permission.READ,
           description="The campaign's selection and progress: built, hit, failed (with the compiler's error) "
                       "and refused items. 404 for an unknown campaign, and for a token that may not read every "
                       "team's builds.",
           responses={200: CampaignOut}, problems=(404,))
def get_campaign(campaign_id: int) -> Response:
    ctx = web()
    with ctx.services.sessions() as session:
        campaign = session.get(Campaign, campaign_id)
        if campaign is None or not team_reads.may_read_campaigns(readers.reader()):
            raise Problem("campaign-not-found", f"no campaign {campaign_id}")
        return respond(CampaignOut, campaign_json(ctx, session, campaign))
