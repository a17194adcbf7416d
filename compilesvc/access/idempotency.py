"""Idempotency keys with Stripe's semantics, per token: the first request with a key records which build
it made and the status it was answered with; a repeat with the same body (its ``request_hash``) within the
key's lifetime finds that build, one with another body is refused (:class:`IdempotencyConflict`), and an
expired key is new again. The relay's sweep deletes expired keys (:func:`delete_expired`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from compilesvc.ledger.models import IdempotencyKey, utcnow
from compilesvc.ledger.sql import insert_ignore_duplicate
from compilesvc.refusals import IdempotencyConflict


@dataclass(frozen=True)
class FirstAnswer:
    build_id: int
    status: int


def cutoff(lifetime_seconds: float) -> datetime:
    """Keys made at or before this have expired."""
    return utcnow() - timedelta(seconds=lifetime_seconds)


def find(session: Session, token_id: int, key: str, request_hash: str, lifetime_seconds: float) -> FirstAnswer | None:
    """The first answer to this token's live ``key``; :class:`IdempotencyConflict` for another body."""
    entry = session.get(IdempotencyKey, (token_id, key))
    if entry is None or entry.created_at <= cutoff(lifetime_seconds):
        return None
    if entry.request_hash != request_hash:
        raise IdempotencyConflict(key)
    return FirstAnswer(entry.build_id, entry.status)


def claim(session: Session, token_id: int, key: str, request_hash: str, build_id: int, status: int,
          lifetime_seconds: float) -> bool:
    """Record ``key`` for ``build_id`` in ``session``'s transaction; False when a concurrent request took it
    first (the caller rolls back and replays). An expired entry of the key goes in the same transaction."""
    session.execute(delete(IdempotencyKey).where(IdempotencyKey.token_id == token_id, IdempotencyKey.key == key,
                                                 IdempotencyKey.created_at <= cutoff(lifetime_seconds)))
    return insert_ignore_duplicate(session, IdempotencyKey, {
        "token_id": token_id, "key": key, "request_hash": request_hash, "build_id": build_id, "status": status,
        "created_at": utcnow(),
    }, ["token_id", "key"])


def delete_expired(session: Session, lifetime_seconds: float) -> int:
    """Remove every expired key (the relay's sweep); how many."""
    result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at <= cutoff(lifetime_seconds)))
    return int(getattr(result, "rowcount", 0) or 0)
