"""Portable SQL building blocks the ledger's services share (Postgres and SQLite alike)."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, literal
from sqlalchemy.dialects.postgresql import Insert as PgInsert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import Insert as SqliteInsert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from compilesvc.ledger.models import Base


def _insert(session: Session, model: type[Base], values: dict[str, Any]) -> PgInsert | SqliteInsert:
    """The dialect's INSERT (the two ledgers we support both have ``ON CONFLICT``)."""
    builder = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    return builder(cast(Table, model.__table__)).values(**values)


def insert_ignore(session: Session, model: type[Base], values: dict[str, Any], conflict: list[str]) -> int | None:
    """``INSERT … ON CONFLICT (conflict) DO NOTHING RETURNING id``: the new id, or None if a row existed.

    On Postgres a concurrent uncommitted insert of the same key makes this wait for that transaction, so
    a None always means a committed (or our own) row exists and can be read.
    """
    stmt = _insert(session, model, values).on_conflict_do_nothing(index_elements=conflict)
    result: int | None = session.execute(stmt.returning(cast(Table, model.__table__).c.id)).scalar_one_or_none()
    return result


def insert_ignore_duplicate(session: Session, model: type[Base], values: dict[str, Any], conflict: list[str]) -> bool:
    """``INSERT … ON CONFLICT (conflict) DO NOTHING``, for tables without an ``id`` to return: whether a row
    was inserted."""
    # RETURNING, not rowcount: psycopg reports -1 for an INSERT … ON CONFLICT run through the ORM session.
    stmt = _insert(session, model, values).on_conflict_do_nothing(index_elements=conflict)
    return session.execute(stmt.returning(literal(1))).scalar_one_or_none() is not None


def upsert(session: Session, model: type[Base], values: dict[str, Any], conflict: list[str]) -> None:
    """``INSERT … ON CONFLICT (conflict) DO UPDATE``: every other column of ``values`` is overwritten."""
    stmt = _insert(session, model, values)
    session.execute(stmt.on_conflict_do_update(
        index_elements=conflict, set_={k: stmt.excluded[k] for k in values if k not in conflict}))
