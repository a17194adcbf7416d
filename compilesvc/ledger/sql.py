"""Portable SQL building blocks the ledger's services share (Postgres and SQLite alike)."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from compilesvc.ledger.models import Base


def insert_ignore(session: Session, model: type[Base], values: dict[str, Any], conflict: list[str]) -> int | None:
    """``INSERT … ON CONFLICT (conflict) DO NOTHING RETURNING id``: the new id, or None if a row existed.

    On Postgres a concurrent uncommitted insert of the same key makes this wait for that transaction, so
    a None always means a committed (or our own) row exists and can be read.
    """
    table = cast(Table, model.__table__)
    builder = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = builder(table).values(**values).on_conflict_do_nothing(index_elements=conflict)
    result: int | None = session.execute(stmt.returning(table.c.id)).scalar_one_or_none()
    return result
