"""``GET /v1/builds/{id}/webhooks``: a build's webhook URLs, and every delivery with every try
(:mod:`compilesvc.notify.webhooks` sends them)."""

from __future__ import annotations

from flask import Blueprint, Response, g
from sqlalchemy import select

from compilesvc.access.tokens import Permission
from compilesvc.ledger.webhooks import Webhook, WebhookAttempt, WebhookDelivery
from web import readers
from web.api.params import respond
from web.context import web
from web.contract.openapi import operation
from web.contract.schemas import WebhookDeliveries

bp = Blueprint("webhooks", __name__, url_prefix="/v1/builds")


@bp.get("/<ledger_id:build_id>/webhooks")
@operation(summary="A build's webhooks: URLs, deliveries and every try", tag="builds", access=Permission.READ,
           description="The callback URLs of the build's spec, each delivery (the event, its state) and every "
                       "attempt with the receiver's status or the error: why a callback did not arrive.",
           responses={200: WebhookDeliveries}, problems=(404,))
def build_webhooks(build_id: int) -> Response:
    g.build_id = build_id
    with web().services.sessions() as session:
        readers.require_build(session, build_id)
        # A delivery of a service-wide subscription has no webhook row (webhook_id None): no URL here.
        hooks: dict[int | None, str] = {
            h.id: h.url for h in session.scalars(select(Webhook).where(Webhook.build_id == build_id)
                                                 .order_by(Webhook.id))}
        deliveries = list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.build_id == build_id)
                                          .order_by(WebhookDelivery.id)))
        tries: dict[int, list[WebhookAttempt]] = {}
        for attempt in session.scalars(
                select(WebhookAttempt).where(WebhookAttempt.delivery_id.in_([d.id for d in deliveries]))
                .order_by(WebhookAttempt.id)):
            tries.setdefault(attempt.delivery_id, []).append(attempt)
        body = {"build_id": build_id, "urls": list(hooks.values()), "deliveries": [{
            "id": f"whd_{d.id}", "url": hooks.get(d.webhook_id, ""), "event": d.event, "state": d.state,
            "attempts": [{"attempt": a.attempt, "at": a.at, "status_code": a.status_code, "error": a.error,
                          "duration_ms": a.duration_ms} for a in tries.get(d.id, [])],
            "next_attempt_at": d.next_attempt_at if d.state == "pending" else None,
            "created_at": d.created_at, "delivered_at": d.delivered_at,
        } for d in deliveries]}
    return respond(WebhookDeliveries, body)
