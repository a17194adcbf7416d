"""API tokens: who a request comes from and what it may do.

A token is a random secret (``csvc_`` + 43 URL-safe characters, 256 bits) shown once, when it is made;
the ledger keeps only its sha256 (``api_tokens.token_hash``), so a copy of the database holds nothing a
client could present. A plain hash is enough because the secret is random and long, not a password: no
dictionary applies, and a lookup by hash is constant-time with respect to the secret.

Each token has a name, an owner (recorded as the submitter of its builds), a team (whose builds it may
cancel and retry), scopes, an optional expiry, and its last use. The scopes nest: ``admin`` ⊃ ``submit``
⊃ ``read`` ⊃ the artifact lookups; a ``fleet`` token has only the artifact lookups (resolve and fetch
by key), for the serving fleet's boot path. What each endpoint needs is in docs/security.md.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from compilesvc.access import ui_sessions
from compilesvc.ledger.models import ApiToken, utcnow
from compilesvc.ledger.sql import insert_ignore

TOKEN_PREFIX = "csvc_"
#: How often a token's ``last_used_at`` is written at most: an hour-old "last used" is still useful, a
#: write per request is not.
LAST_USED_RESOLUTION = timedelta(minutes=1)
MAX_NAME = 100
MAX_OWNER = 255
#: Names, owners and teams: no control characters, no blanks at either end. Written so that Python's
#: ``re.fullmatch`` and ECMA-262 (the OpenAPI document's pattern) agree.
_VISIBLE = "[^ \\t\\n\\r\\x00-\\x1f\\x7f-\\x9f]"
TEXT_PATTERN = f"^{_VISIBLE}(?:[^\\x00-\\x1f\\x7f-\\x9f]*{_VISIBLE})?$"


class Scope(StrEnum):
    """What a token is granted."""

    FLEET = "fleet"
    READ = "read"
    SUBMIT = "submit"
    ADMIN = "admin"


class Permission(StrEnum):
    """What an endpoint needs."""

    ARTIFACTS = "artifacts"  # resolve a spec, look up an artifact by key
    READ = "read"            # builds, logs, history, workers
    SUBMIT = "submit"        # upload models, submit, cancel and retry (own team's builds)
    ADMIN = "admin"          # tokens; cancel and retry any build


GRANTS: dict[Scope, frozenset[Permission]] = {
    Scope.FLEET: frozenset({Permission.ARTIFACTS}),
    Scope.READ: frozenset({Permission.ARTIFACTS, Permission.READ}),
    Scope.SUBMIT: frozenset({Permission.ARTIFACTS, Permission.READ, Permission.SUBMIT}),
    Scope.ADMIN: frozenset(Permission),
}


class TokenError(ValueError):
    """A token cannot be made as asked (bad name, scopes, expiry)."""


@dataclass(frozen=True)
class Principal:
    """The authenticated token of a request."""

    token_id: int
    name: str
    owner: str
    team: str
    scopes: frozenset[Scope]
    expires_at: datetime | None

    def allows(self, permission: Permission) -> bool:
        return any(permission in GRANTS[scope] for scope in self.scopes)

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def may_control(self, team: str | None) -> bool:
        """Whether this token may cancel or retry a build of ``team``: admins any, submitters their team's."""
        return self.is_admin or (self.allows(Permission.SUBMIT) and team is not None and team == self.team)


def token_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def looks_like_token(secret: str) -> bool:
    """The shape every token has (bootstrap tokens chosen by an operator included): checked before the
    ledger is asked, so that garbage costs no query."""
    return secret.startswith(TOKEN_PREFIX) and 32 <= len(secret) <= 200 and secret.isascii() and secret.isprintable()


def parse_scopes(values: Iterable[str]) -> frozenset[Scope]:
    scopes: set[Scope] = set()
    for value in values:
        for part in value.replace(",", " ").split():
            try:
                scopes.add(Scope(part))
            except ValueError:
                raise TokenError(f"unknown scope {part!r}; scopes are {', '.join(s.value for s in Scope)}") from None
    if not scopes:
        raise TokenError("a token needs at least one scope")
    if Scope.FLEET in scopes and len(scopes) > 1:
        raise TokenError("a fleet token has the fleet scope only (it can resolve and download artifacts)")
    return frozenset(scopes)


def _check_text(what: str, value: str, limit: int) -> str:
    if len(value) > limit or not re.fullmatch(TEXT_PATTERN, value):
        raise TokenError(f"{what} must be 1 to {limit} characters, no control characters, no blanks at either end")
    return value


@dataclass(frozen=True)
class NewToken:
    token: ApiToken
    secret: str


def create_token(session: Session, *, name: str, owner: str, scopes: Iterable[str], team: str | None = None,
                 expires_at: datetime | None = None, created_by: str | None = None,
                 secret: str | None = None) -> NewToken:
    """Make a token in ``session``'s transaction; the secret is in the result and nowhere else."""
    scope_set = parse_scopes(scopes)
    now = utcnow()
    if expires_at is not None and expires_at <= now:
        raise TokenError("the expiry is in the past")
    secret = secret or new_secret()
    if not looks_like_token(secret):
        raise TokenError(f"a token is {TOKEN_PREFIX!r} followed by at least 27 printable ASCII characters")
    row = ApiToken(name=_check_text("name", name, MAX_NAME), owner=_check_text("owner", owner, MAX_OWNER),
                   team=_check_text("team", team or owner, MAX_OWNER), scopes=sorted(scope_set),
                   token_hash=token_hash(secret), hint=secret[: len(TOKEN_PREFIX) + 4], created_at=now,
                   created_by=created_by, expires_at=expires_at)
    session.add(row)
    session.flush()
    return NewToken(row, secret)


def ensure_token(session: Session, secret: str, *, name: str, owner: str, scopes: Iterable[str]) -> None:
    """Register an operator-chosen token (the bootstrap token) unless its hash is known already. A revoked
    one stays revoked: registering again does not bring it back."""
    if not looks_like_token(secret):
        raise TokenError(f"a token is {TOKEN_PREFIX!r} followed by at least 27 printable ASCII characters")
    insert_ignore(session, ApiToken, {
        "name": name, "owner": owner, "team": owner, "scopes": sorted(parse_scopes(scopes)),
        "token_hash": token_hash(secret), "hint": secret[: len(TOKEN_PREFIX) + 4], "created_at": utcnow(),
        "created_by": "bootstrap",
    }, ["token_hash"])


def principal_of(row: ApiToken) -> Principal:
    return Principal(token_id=row.id, name=row.name, owner=row.owner, team=row.team,
                     scopes=frozenset(Scope(s) for s in row.scopes if s in Scope._value2member_map_),
                     expires_at=row.expires_at)


def is_active(row: ApiToken, now: datetime) -> bool:
    return row.revoked_at is None and (row.expires_at is None or row.expires_at > now)


def authenticate(session: Session, secret: str) -> Principal | None:
    """The token's principal, or None for anything that is not a live token (unknown, revoked, expired):
    callers answer all three alike, so an answer never tells which tokens exist. Reads only: a flood of
    made-up tokens takes no write lock."""
    if not looks_like_token(secret):
        return None
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash(secret)))
    return principal_of(row) if row is not None and is_active(row, utcnow()) else None


def record_use(session: Session, token_id: int) -> None:
    """Note that the token was used now (at most once per :data:`LAST_USED_RESOLUTION`)."""
    now = utcnow()
    session.execute(update(ApiToken).where(
        ApiToken.id == token_id,
        (ApiToken.last_used_at.is_(None)) | (ApiToken.last_used_at <= now - LAST_USED_RESOLUTION),
    ).values(last_used_at=now))


def active_principal(session: Session, token_id: int) -> Principal | None:
    """The principal of token ``token_id`` while it is live (a UI session re-checks its token by id)."""
    row = session.get(ApiToken, token_id)
    return principal_of(row) if row is not None and is_active(row, utcnow()) else None


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[ApiToken]:
    query = select(ApiToken).order_by(ApiToken.id)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke(session: Session, token_id: int) -> ApiToken | None:
    """Revoke token ``token_id`` (idempotent: an already revoked token keeps its time); None if unknown.
    Every UI session made with it ends too (:mod:`compilesvc.access.ui_sessions`)."""
    row = session.get(ApiToken, token_id, with_for_update=True)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
    if row is not None:
        ui_sessions.end_all(session, token_id)
    return row
