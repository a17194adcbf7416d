"""``/v1/tokens``: make, list and revoke API tokens (admin only). The secret of a new token is in the one
answer that makes it; the ledger keeps its sha256 (:mod:`compilesvc.access.tokens`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from flask import Blueprint, Response

from compilesvc.access import tokens
from compilesvc.access.tokens import Permission
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ApiToken, utcnow
from web.api.params import model_body, respond
from web.auth import current_principal
from web.context import web
from web.contract.inputs import TokenListQuery
from web.contract.openapi import operation
from web.contract.problems import Problem
from web.contract.schemas import TokenCreate, TokenCreated, TokenList, TokenOut

bp = Blueprint("tokens", __name__, url_prefix="/v1/tokens")


def token_json(row: ApiToken) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "owner": row.owner, "team": row.team, "scopes": list(row.scopes),
            "hint": row.hint, "created_at": row.created_at, "created_by": row.created_by,
            "expires_at": row.expires_at, "last_used_at": row.last_used_at, "revoked_at": row.revoked_at}


@bp.get("")
@operation(summary="API tokens (never their secrets)", tag="tokens", access=Permission.ADMIN, query=TokenListQuery,
           description="Each token's name, owner, team, scopes and expiry; revoked ones only with `all`. "
                       "Secrets are stored hashed and shown only when a token is made.",
           responses={200: TokenList})
def list_tokens(query: TokenListQuery) -> Response:
    with web().services.sessions() as session:
        rows = tokens.list_tokens(session, include_revoked=query.all)
        return respond(TokenList, {"items": [token_json(row) for row in rows]})


@bp.post("")
@operation(summary="Make an API token", tag="tokens", access=Permission.ADMIN, request=TokenCreate,
           description="The answer holds the token's secret, once; store it where its user will read it.",
           responses={201: TokenCreated}, problems=(400, 413, 422))
def create_token() -> Response:
    asked = model_body(TokenCreate, "token-invalid")
    principal = current_principal()
    expires_at = utcnow() + timedelta(seconds=asked.expires_in_seconds) if asked.expires_in_seconds else None
    try:
        with transaction(web().services.sessions) as session:
            made = tokens.create_token(session, name=asked.name, owner=asked.owner, team=asked.team,
                                       scopes=asked.scopes, expires_at=expires_at,
                                       created_by=principal.owner if principal else None)
            body = {**token_json(made.token), "token": made.secret}
    except tokens.TokenError as exc:
        raise Problem("token-invalid", str(exc)) from None
    return respond(TokenCreated, body, 201)


@bp.post("/<ledger_id:token_id>/revoke")
@operation(summary="Revoke an API token", tag="tokens", access=Permission.ADMIN,
           description="At once in this process, and within `token_cache_seconds` in every other API process. "
                       "Revoking twice is not an error; the first time is kept.",
           responses={200: TokenOut}, problems=(404,))
def revoke_token(token_id: int) -> Response:
    ctx = web()
    with transaction(ctx.services.sessions) as session:
        row = tokens.revoke(session, token_id)
        if row is None:
            raise Problem("token-not-found", f"no token {token_id}")
        body = token_json(row)
        ctx.tokens.forget(tokens.principal_of(row), row.token_hash)
    return respond(TokenOut, body)
