"""Database engines and sessions for the ledger, tuned per backend (Postgres or SQLite).

SQLite is the embedded default. It gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` transactions so that
concurrent writers in separate processes queue up instead of failing on lock upgrades, in the order they
came (:mod:`compilesvc.ledger.sqlite_writer`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.sqlite_writer import WriterConnection

#: Seconds a SQLite writer waits for the write lock by default.
_SQLITE_TIMEOUT = 30.0


def normalise_url(url: str) -> str:
    """Pick the psycopg 3 driver for plain postgres URLs."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def sqlite_timeout(url: str) -> float:
    """A SQLite URL's ``?timeout=`` (seconds a writer waits for the write lock), or the default."""
    raw = make_url(url).query.get("timeout", _SQLITE_TIMEOUT)
    try:
        timeout = float(str(raw))
    except ValueError:
        timeout = -1
    if not 0 <= timeout < 86400:
        raise ValueError(f"the SQLite URL's timeout must be a number of seconds, got {raw!r}")
    return timeout


CONNECT_TIMEOUT_SECONDS = 10
TCP_USER_TIMEOUT_MS = 60_000
PG_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": CONNECT_TIMEOUT_SECONDS, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
    "keepalives_count": 3, "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
}


def make_engine(url: str, **kwargs: Any) -> Engine:
    url = normalise_url(url)
    if url.startswith("sqlite"):
        # How long a writer waits for its turn before "database is locked": ?timeout=SECONDS in the URL.
        timeout = sqlite_timeout(url)
        engine = create_engine(url, connect_args={"timeout": timeout, "isolation_level": None,
                                                  "factory": WriterConnection}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Take the write lock up front: a deferred transaction that later writes can fail with
            # SQLITE_BUSY without waiting, which would turn concurrent submits into errors. Writers queue for
            # it in order (compilesvc.ledger.sqlite_writer) rather than in SQLite's sleeping busy handler.
            # An error here (the lock stayed busy past the timeout) is raised outside SQLAlchemy's own
            # wrapping of BEGIN: wrap it, so callers see the DBAPIError they handle (the API's 503).
            try:
                conn.connection.dbapi_connection.begin_immediate()
            except sqlite3.Error as exc:
                raise DBAPIError.instance("BEGIN IMMEDIATE", None, exc, sqlite3.Error) from exc

        return engine
    # No pre-ping: it is a round trip on every checkout, on every submit and lookup. A connection that
    # died with the server fails its first statement instead; SQLAlchemy then invalidates the whole pool,
    # and the API answers that one request 503 with Retry-After (clients retry). Recycling keeps idle
    # connections younger than the idle timeouts of servers and proxies.
    kwargs.setdefault("pool_recycle", 1800)
    # A server that vanished without a reset (an RDS failover, a partition) must not hang a process for the
    # kernel's two hours: a connect gives up after CONNECT_TIMEOUT_SECONDS, an idle connection is probed by
    # TCP keepalives, and data left unacknowledged fails the connection after TCP_USER_TIMEOUT_MS (libpq's
    # connect_timeout, keepalives*, tcp_user_timeout: PostgreSQL docs, "Parameter Key Words", 34.1.2). What
    # these cannot see — a proxy that keeps the socket and stops forwarding — is the relay's and the
    # worker's liveness check's to catch.
    # The URL's own (?connect_timeout=3) win: SQLAlchemy lets connect_args override the URL's query.
    connect_args = kwargs.setdefault("connect_args", {})
    given = make_url(url).query
    for name, value in PG_CONNECT_ARGS.items():
        if name not in given:
            connect_args.setdefault(name, value)
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
