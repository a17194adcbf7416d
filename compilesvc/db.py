"""Database engines and sessions for the ledger, tuned per backend (Postgres or SQLite).

SQLite is the embedded default. It gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` transactions so that
concurrent writers in separate processes queue up instead of failing on lock upgrades, in the order they
came (:mod:`compilesvc.sqlite_writer`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.sqlite_writer import WriterConnection


def normalise_url(url: str) -> str:
    """Pick the psycopg 3 driver for plain postgres URLs."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, **kwargs: Any) -> Engine:
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None, "factory": WriterConnection},
                               **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Take the write lock up front: a deferred transaction that later writes can fail with
            # SQLITE_BUSY without waiting, which would turn concurrent submits into errors. Writers queue for
            # it in order (compilesvc.sqlite_writer) rather than in SQLite's sleeping busy handler.
            conn.connection.dbapi_connection.begin_immediate()

        return engine
    # No pre-ping: it is a round trip on every checkout, on every submit and lookup. A connection that
    # died with the server fails its first statement instead; SQLAlchemy then invalidates the whole pool,
    # and the API answers that one request 503 with Retry-After (clients retry). Recycling keeps idle
    # connections younger than the idle timeouts of servers and proxies.
    kwargs.setdefault("pool_recycle", 1800)
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
    return create_engine(url, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work commits on normal exit and rolls back on error."""
    with factory() as session, session.begin():
        yield session
