"""``/v1/subscriptions``: URLs notified service-wide of ``artifact.published``, ``build.failed``,
``campaign.started``, ``campaign.finished`` (:mod:`compilesvc.notify.webhooks`), for deployment systems;
admin only (a subscriber learns about every team's builds)."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import Permission
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.sql import insert_ignore
from compilesvc.ledger.webhooks import EventSubscription, WebhookDelivery
from compilesvc.notify.webhooks import check_url
from web.api.params import model_body, respond
from web.auth import current_principal
from web.context import web
from web.contract.fleet_schemas import SubscriptionCreate, SubscriptionList, SubscriptionOut
from web.contract.openapi import operation
from web.contract.problems import Problem

bp = Blueprint("subscriptions", __name__, url_prefix="/v1/subscriptions")
RECENT = 20


def subscription_json(session: Session, row: EventSubscription) -> dict[str, Any]:
    deliveries = session.scalars(select(WebhookDelivery).where(WebhookDelivery.subscription_id == row.id)
                                 .order_by(WebhookDelivery.id.desc()).limit(RECENT))
    return {"id": row.id, "url": row.url, "event": row.event, "created_by": row.created_by,
            "created_at": row.created_at, "recent_deliveries": [{
                "id": f"whd_{d.id}", "subject_id": d.subject_id, "state": d.state, "attempts": d.attempts,
                "last_status": d.last_status, "last_error": d.last_error, "created_at": d.created_at,
                "delivered_at": d.delivered_at} for d in deliveries]}


@bp.get("")
@operation(summary="Event subscriptions and their recent deliveries", tag="subscriptions",
           access=Permission.ADMIN, responses={200: SubscriptionList},
           description="Every service-wide subscription (a URL and the event it receives) with its recent "
                       "deliveries and their state: what a receiver was sent and whether it answered.")
def list_subscriptions() -> Response:
    with web().services.sessions() as session:
        rows = session.scalars(select(EventSubscription).order_by(EventSubscription.id)).all()
        return respond(SubscriptionList, {"items": [subscription_json(session, row) for row in rows]})


@bp.post("")
@operation(summary="Subscribe a URL to an event", tag="subscriptions", access=Permission.ADMIN,
           request=SubscriptionCreate,
           description="201 with the subscription; 200 when this URL has this event already. The URL is checked "
                       "as callbacks are (no loopback, link-local, private or reserved address unless "
                       "COMPILESVC_WEBHOOK_ALLOW_NETWORKS allows it), here and before every delivery.",
           responses={201: SubscriptionOut, 200: SubscriptionOut}, problems=(400, 413, 422))
def create_subscription() -> Response:
    asked = model_body(SubscriptionCreate, "subscription-invalid")
    ctx = web()
    try:
        check_url(asked.url, ctx.settings.webhook_networks)
    except ValueError as exc:
        raise Problem("subscription-invalid", f"url: {exc}") from None
    principal = current_principal()
    with transaction(ctx.services.sessions) as session:
        made = insert_ignore(session, EventSubscription, {"url": asked.url, "event": asked.event,
                                                          "created_by": principal.owner if principal else None},
                             ["url", "event"])
        row = session.scalars(select(EventSubscription).where(EventSubscription.url == asked.url,
                                                              EventSubscription.event == asked.event)).one()
        body = subscription_json(session, row)
    return respond(SubscriptionOut, body, 201 if made is not None else 200)


@bp.delete("/<ledger_id:subscription_id>")
@operation(summary="Unsubscribe", tag="subscriptions", access=Permission.ADMIN, responses={200: SubscriptionOut},
           description="Deliveries not yet sent are dropped with it.", problems=(404,))
def delete_subscription(subscription_id: int) -> Response:
    with transaction(web().services.sessions) as session:
        row = session.get(EventSubscription, subscription_id)
        if row is None:
            raise Problem("subscription-not-found", f"no subscription {subscription_id}")
        body = subscription_json(session, row)
        session.delete(row)
    return respond(SubscriptionOut, body)
