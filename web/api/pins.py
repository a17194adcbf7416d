"""``/v1/pins``: what retention never deletes (:mod:`compilesvc.lifecycle.retention`): read by anyone who may read
builds, changed by admins."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response
from sqlalchemy import select

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.retention import RetentionPin
from compilesvc.ledger.sql import insert_ignore
from web import readers
from web.api.params import model_body, respond
from web.auth import current_principal
from web.context import web
from web.contract.fleet_schemas import PinCreate, PinList, PinOut
from web.contract.openapi import operation
from web.contract.problems import Problem

bp = Blueprint("pins", __name__, url_prefix="/v1/pins")


def pin_json(row: RetentionPin) -> dict[str, Any]:
    return {"id": row.id, "kind": row.kind, "value": row.value, "note": row.note, "created_by": row.created_by,
            "created_at": row.created_at}


@bp.get("")
@operation(summary="Retention pins", tag="retention", access=Permission.READ, responses={200: PinList},
           description="The pins that keep artifacts from `compilesvc gc`, those this token's team may read, "
                       "oldest first.")
def list_pins() -> Response:
    with web().services.sessions() as session:
        rows = session.scalars(select(RetentionPin).where(*team_reads.pin_conditions(readers.reader()))
                               .order_by(RetentionPin.id)).all()
        return respond(PinList, {"items": [pin_json(row) for row in rows]})


@bp.post("")
@operation(summary="Pin artifacts against retention", tag="retention", access=Permission.ADMIN, request=PinCreate,
           description="201 with the new pin; 200 with the existing one when the same kind and value are pinned "
                       "already.", responses={201: PinOut, 200: PinOut}, problems=(400, 413, 422))
def create_pin() -> Response:
    asked = model_body(PinCreate, "pin-invalid").root
    value = asked.value
    principal = current_principal()
    with transaction(web().services.sessions) as session:
        made = insert_ignore(session, RetentionPin, {"kind": asked.kind, "value": value, "note": asked.note,
                                                     "created_by": principal.owner if principal else None},
                             ["kind", "value"])
        row = session.scalars(select(RetentionPin).where(RetentionPin.kind == asked.kind,
                                                         RetentionPin.value == value)).one()
        body = pin_json(row)
    return respond(PinOut, body, 201 if made is not None else 200)


@bp.delete("/<ledger_id:pin_id>")
@operation(summary="Remove a pin", tag="retention", access=Permission.ADMIN, responses={200: PinOut},
           description="Answers the removed pin. The artifacts it kept fall under the retention policy again "
                       "from the next `compilesvc gc`.",
           problems=(404,))
def delete_pin(pin_id: int) -> Response:
    with transaction(web().services.sessions) as session:
        row = session.get(RetentionPin, pin_id)
        if row is None:
            raise Problem("pin-not-found", f"no pin {pin_id}")
        body = pin_json(row)
        session.delete(row)
    return respond(PinOut, body)
