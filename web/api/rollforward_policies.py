"""``/v1/rollforward-policies``: standing roll-forwards (:mod:`compilesvc.lifecycle.policies`): when the first
worker of a new SDK release registers, each enabled policy covering its target starts a campaign to that
release. Managed by an admin; read by anyone who may read campaigns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flask import Blueprint, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission
from compilesvc.builds.policy_submits import policy_submit
from compilesvc.ledger.campaigns import RollforwardPolicy
from compilesvc.ledger.engine import transaction
from compilesvc.lifecycle import policies
from web import readers
from web.api.params import model_body, respond
from web.auth import current_principal
from web.context import WebContext, web
from web.contract.fleet_schemas import PolicyIn, PolicyList, PolicyOut
from web.contract.openapi import operation
from web.contract.problems import Problem

bp = Blueprint("rollforward_policies", __name__, url_prefix="/v1/rollforward-policies")


def policy_json(ctx: WebContext, session: Session, policy: RollforwardPolicy) -> dict[str, Any]:
    runs = [{"to_sdk": run.to_sdk, "target": run.target, "worker_id": run.worker_id, "from_sdk": run.from_sdk,
             "campaign_id": run.campaign_id, "note": run.note, "created_at": run.created_at,
             "campaign_url": ctx.url(f"/v1/campaigns/{run.campaign_id}") if run.campaign_id else None}
            for run in policies.runs_of(session, policy.id)]
    return {"id": policy.id, "name": policy.name, "target": policy.target, "from_sdk": policy.from_sdk,
            "model": policy.model, "labels": policy.labels, "pinned": policy.pinned,
            "fetched_within_days": policy.fetched_within_days, "enabled": policy.enabled,
            "created_by": policy.created_by, "created_at": policy.created_at, "runs": runs,
            "url": ctx.url(f"/v1/rollforward-policies/{policy.id}")}


def _readable() -> None:
    if not team_reads.may_read_campaigns(readers.reader()):
        raise Problem("policy-not-found", "no such policy")


@bp.post("")
@operation(summary="Add a standing roll-forward policy", tag="campaigns", access=Permission.ADMIN,
           request=PolicyIn,
           description="When the first worker of an SDK release no worker had before registers for a target the "
                       "policy covers, a roll-forward campaign (as `POST /v1/campaigns/rollforward` with the "
                       "policy's selection, its compiles queued) starts by itself, once per policy and release, "
                       "and subscribers of `campaign.started` are told. `from_sdk` null: the newest older "
                       "release with published artifacts of the target. 201 with the policy; 409 "
                       "`policy-exists` for a name taken.",
           responses={201: PolicyOut}, problems=(400, 409, 413, 422))
def create_policy() -> Response:
    asked = model_body(PolicyIn, "policy-invalid")
    principal = current_principal()
    ctx = web()
    with transaction(ctx.services.sessions) as session:
        try:
            policy = policies.add(session, name=asked.name, target=asked.target, from_sdk=asked.from_sdk,
                                  model=asked.model, labels=dict(asked.labels), pinned=asked.pinned,
                                  fetched_within_days=asked.fetched_within_days, enabled=asked.enabled,
                                  created_by=principal.owner if principal else None)
        except policies.PolicyExists as exc:
            raise Problem("policy-exists", exc.message) from None
        except policies.PolicyError as exc:
            raise Problem("policy-invalid", str(exc), errors=[{"field": exc.field, "message": exc.message}]) from None
        body = policy_json(ctx, session, policy)
    return respond(PolicyOut, body, 201, headers={"Location": body["url"]})


@bp.get("")
@operation(summary="Standing roll-forward policies", tag="campaigns", access=Permission.READ,
           description="Every policy, oldest first, with the releases it fired for and their campaigns; empty "
                       "for a token that may not read every team's builds.",
           responses={200: PolicyList})
def list_policies() -> Response:
    ctx = web()
    with ctx.services.sessions() as session:
        shown = team_reads.may_read_campaigns(readers.reader())
        rows: Iterable[RollforwardPolicy] = (
            session.scalars(select(RollforwardPolicy).order_by(RollforwardPolicy.id)) if shown else [])
        return respond(PolicyList, {"items": [policy_json(ctx, session, row) for row in rows]})


@bp.get("/<policy_ref>")
@operation(summary="A roll-forward policy", tag="campaigns", access=Permission.READ,
           description="By id or name: the policy, the releases it fired for and their campaigns.",
           responses={200: PolicyOut}, problems=(404,))
def get_policy(policy_ref: str) -> Response:
    ctx = web()
    _readable()
    with ctx.services.sessions() as session:
        policy = policies.find(session, policy_ref)
        if policy is None:
            raise Problem("policy-not-found", f"no policy {policy_ref!r}")
        return respond(PolicyOut, policy_json(ctx, session, policy))


@bp.delete("/<policy_ref>")
@operation(summary="Remove a roll-forward policy", tag="campaigns", access=Permission.ADMIN,
           description="By id or name; answers the removed policy. Campaigns it started go on (and keep their "
                       "builds); they no longer name it.",
           responses={200: PolicyOut}, problems=(404,))
def delete_policy(policy_ref: str) -> Response:
    ctx = web()
    with transaction(ctx.services.sessions) as session:
        policy = policies.find(session, policy_ref)
        if policy is None:
            raise Problem("policy-not-found", f"no policy {policy_ref!r}")
        body = policy_json(ctx, session, policy)
        session.delete(policy)
    return respond(PolicyOut, body)


def _set_enabled(policy_ref: str, enabled: bool) -> Response:
    ctx = web()
    principal = current_principal()
    with transaction(ctx.services.sessions) as session:
        policy = policies.find(session, policy_ref)
        if policy is None:
            raise Problem("policy-not-found", f"no policy {policy_ref!r}")
        caught_up = []
        if enabled and not policy.enabled:  # the releases it missed while disabled (policies.catch_up)
            caught_up = policies.catch_up(session, policy, ctx.settings.worker_stale_seconds,
                                          f"enabled by {principal.owner}"[:255] if principal else "enabled")
        policy.enabled = enabled
        policy_id = policy.id

    submit = policy_submit(ctx.submitter)  # as the registering worker does: compiles queued for workers
    for claimed in caught_up:  # after commit; a start that dies here is the relay's (policies.start_stalled)
        policies.start_claimed(ctx.services.sessions, claimed, submit)
    with ctx.services.sessions() as session:
        body = policy_json(ctx, session, session.get_one(RollforwardPolicy, policy_id))
    return respond(PolicyOut, body)


@bp.post("/<policy_ref>/enable")
@operation(summary="Enable a roll-forward policy", tag="campaigns", access=Permission.ADMIN,
           description="By id or name; answers the policy (its runs). It fires for the next release new to the "
                       "fleet, and at once for each release it missed while disabled: first seen after the policy "
                       "was created, served by a live worker now, with no run of this policy; a disabled policy "
                       "enabled again catches up with the fleet. Enabling an enabled policy starts nothing.",
           responses={200: PolicyOut}, problems=(404,))
def enable_policy(policy_ref: str) -> Response:
    return _set_enabled(policy_ref, True)


@bp.post("/<policy_ref>/disable")
@operation(summary="Disable a roll-forward policy", tag="campaigns", access=Permission.ADMIN,
           description="By id or name; answers the policy, which starts nothing until enabled again.",
           responses={200: PolicyOut}, problems=(404,))
def disable_policy(policy_ref: str) -> Response:
    return _set_enabled(policy_ref, False)
