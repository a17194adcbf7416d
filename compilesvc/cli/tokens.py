"""``compilesvc tokens create|list|revoke``: API tokens, through the API with an admin token, or with
``--ledger`` directly against the ledger database (the first admin token of a deployment).

``create`` prints the new token's secret alone on stdout (``TOKEN=$(compilesvc tokens create …)``) and
what it is on stderr; the secret is never shown again. Exit status: 0 done; 1 the ledger failed (``--ledger``);
2 the command line is wrong (a bad scope, duration or name; an unknown token id) or the API refused it; 3 the
API did not answer or failed (docs/ci.md, "Exit statuses").
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

import click

from compilesvc.access import tokens
from compilesvc.cli.connection import API_OPTION, connect
from compilesvc.cli.main import BadInput, CommandFailed, ledger_services
from compilesvc.client.api import ApiError
from compilesvc.client.next_steps import NEXT_STEPS

_DURATION = re.compile(r"(\d+)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

LEDGER_OPTION = click.option(
    "--ledger", is_flag=True,
    help="Work on the ledger database directly (COMPILESVC_DATABASE_URL, else the embedded SQLite) instead of "
         "through the API: for the first admin token, or when the API is down.")


def parse_duration(text: str) -> int:
    """``90d``, ``12h``, ``30m``, ``3600`` (seconds) -> seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match[1]) == 0:
        raise BadInput(f"--expires-in {text!r}: expected a positive number with s, m, h, d or w, e.g. 90d")
    return int(match[1]) * _UNITS[match[2]]


def _row_json(row: Any) -> dict[str, Any]:
    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {"id": row.id, "name": row.name, "owner": row.owner, "team": row.team, "scopes": list(row.scopes),
            "hint": row.hint, "created_at": when(row.created_at), "created_by": row.created_by,
            "expires_at": when(row.expires_at), "last_used_at": when(row.last_used_at),
            "revoked_at": when(row.revoked_at)}


def _ledger_failed(exc: Exception) -> CommandFailed:
    return CommandFailed(f"the ledger failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")


@click.group("tokens")
def tokens_group() -> None:
    """API tokens: scopes fleet, read, submit, admin (docs/security.md)."""


@tokens_group.command("create")
@click.option("--name", required=True, help="What the token is for, e.g. ci-vision.")
@click.option("--owner", required=True, help="Who uses it: recorded as the submitter of its builds.")
@click.option("--team", help="Whose builds it may cancel and retry (default: the owner).")
@click.option("--scope", "scopes", multiple=True, required=True,
              help="fleet (resolve and download artifacts only), read, submit or admin; repeat or comma-separate.")
@click.option("--expires-in", metavar="DURATION", help="e.g. 90d, 12h (default: never).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole token document (secret included).")
@LEDGER_OPTION
@API_OPTION
def create(name: str, owner: str, team: str | None, scopes: tuple[str, ...], expires_in: str | None,
           as_json: bool, ledger: bool, api: str | None) -> None:
    """Make a token; its secret is printed once, on stdout."""
    seconds = parse_duration(expires_in) if expires_in else None
    try:
        scope_list = sorted(tokens.parse_scopes(scopes))
    except tokens.TokenError as exc:
        raise BadInput(str(exc)) from None
    if ledger:
        from compilesvc.ledger.engine import transaction  # with --ledger alone (start-up cost)
        from compilesvc.ledger.models import utcnow

        with ledger_services() as services:
            try:
                with transaction(services.sessions) as session:
                    made = tokens.create_token(
                        session, name=name, owner=owner, team=team, scopes=scope_list,
                        expires_at=utcnow() + timedelta(seconds=seconds) if seconds else None,
                        created_by="compilesvc tokens --ledger")
                    doc = {**_row_json(made.token), "token": made.secret}
            except tokens.TokenError as exc:
                raise BadInput(str(exc)) from None
            except Exception as exc:
                raise _ledger_failed(exc) from None
    else:
        body = {"name": name, "owner": owner, "team": team, "scopes": scope_list, "expires_in_seconds": seconds}
        doc = connect(api).request("POST", "/v1/tokens", {k: v for k, v in body.items() if v is not None})
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo(doc["token"])
    expiry = f"expires {doc['expires_at']}" if doc.get("expires_at") else "never expires"
    click.echo(f"token {doc['id']} {doc['name']!r}: owner {doc['owner']}, team {doc['team']}, scopes "
               f"{','.join(doc['scopes'])}, {expiry}. The secret above is shown only now.", err=True)


@tokens_group.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@LEDGER_OPTION
@API_OPTION
def list_command(include_revoked: bool, as_json: bool, ledger: bool, api: str | None) -> None:
    """List tokens (never their secrets)."""
    if ledger:
        with ledger_services() as services:
            try:
                with services.sessions() as session:
                    items = [_row_json(row) for row in tokens.list_tokens(session, include_revoked=include_revoked)]
            except Exception as exc:
                raise _ledger_failed(exc) from None
    else:
        items = connect(api).request("GET", "/v1/tokens" + ("?all=true" if include_revoked else ""))["items"]
    if as_json:
        click.echo(json.dumps(items, indent=1))
        return
    click.echo(f"{'ID':>5}  {'NAME':20} {'OWNER':16} {'TEAM':16} {'SCOPES':14} {'HINT':10} {'EXPIRES':20} "
               f"{'LAST USED':20} REVOKED")
    for item in items:
        click.echo(f"{item['id']:>5}  {item['name'][:20]:20} {item['owner'][:16]:16} {item['team'][:16]:16} "
                   f"{','.join(item['scopes']):14} {item['hint']:10} {(item['expires_at'] or '-')[:19]:20} "
                   f"{(item['last_used_at'] or '-')[:19]:20} {(item['revoked_at'] or '-')[:19]}")


@tokens_group.command("revoke")
@click.argument("token_id", type=click.IntRange(min=1), metavar="ID")
@LEDGER_OPTION
@API_OPTION
def revoke(token_id: int, ledger: bool, api: str | None) -> None:
    """Revoke token ID (see `compilesvc tokens list`); API processes stop accepting it within
    COMPILESVC_TOKEN_CACHE_SECONDS."""
    if ledger:
        from compilesvc.ledger.engine import transaction  # with --ledger alone (start-up cost)

        with ledger_services() as services:
            try:
                with transaction(services.sessions) as session:
                    row = tokens.revoke(session, token_id)
                    doc = _row_json(row) if row is not None else None
            except Exception as exc:
                raise _ledger_failed(exc) from None
        if doc is None:
            raise BadInput(f"no token {token_id}; {NEXT_STEPS['token-not-found']}")
    else:
        try:
            doc = connect(api).request("POST", f"/v1/tokens/{token_id}/revoke")
        except ApiError as exc:
            if "HTTP 404" in exc.message:
                raise BadInput(f"no token {token_id}; {NEXT_STEPS['token-not-found']}") from None
            raise
    click.echo(f"token {doc['id']} {doc['name']!r} revoked at {doc['revoked_at']}")
