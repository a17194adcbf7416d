"""UI sessions on the server side: a login makes a ledger row, the cookie carries its random secret, every
request checks the row (and its token), and logout or revocation ends it there. So a copy of the cookie
taken before logout opens nothing afterwards, which a cookie that only names its token could not promise.

The ledger keeps the secret's sha256 only (as for tokens, :mod:`compilesvc.access.tokens`): a copy of the
database holds no cookie anyone could present. The web layer caches a checked session as it caches a
checked token (``token_cache_seconds``), and forgets it at once in the process that ends it.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from compilesvc.ledger.models import utcnow
from compilesvc.ledger.ui_sessions import UiSession

#: How long a login lasts (the cookie's lifetime too).
LIFETIME = timedelta(hours=12)
#: Ended and expired rows are deleted this long after their end (a login sweeps them).
KEPT_AFTER_END = timedelta(days=1)


def session_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def start(db: Session, token_id: int, lifetime: timedelta = LIFETIME) -> str:
    """A new session of token ``token_id``; returns the secret for the cookie (shown nowhere else)."""
    now = utcnow()
    db.execute(delete(UiSession).where(UiSession.expires_at < now - KEPT_AFTER_END))
    secret = secrets.token_urlsafe(32)
    db.add(UiSession(id_hash=session_hash(secret), token_id=token_id, created_at=now, expires_at=now + lifetime))
    db.flush()
    return secret


def live_token_id(db: Session, secret: str) -> int | None:
    """The token of a live session (not ended, not expired), else None. Whether the token itself is still
    live is the caller's next check."""
    now = utcnow()
    return db.scalar(select(UiSession.token_id).where(
        UiSession.id_hash == session_hash(secret), UiSession.ended_at.is_(None), UiSession.expires_at > now))


def end(db: Session, secret: str) -> None:
    """Log out: the session ends for every copy of its cookie."""
    db.execute(update(UiSession).where(UiSession.id_hash == session_hash(secret), UiSession.ended_at.is_(None))
               .values(ended_at=utcnow()))


def end_all(db: Session, token_id: int) -> int:
    """End every live session of a token (its revocation); returns how many."""
    result = db.execute(update(UiSession).where(UiSession.token_id == token_id, UiSession.ended_at.is_(None))
                        .values(ended_at=utcnow()))
    return int(getattr(result, "rowcount", 0) or 0)
