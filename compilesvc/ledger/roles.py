"""Ledger roles on Postgres: the owner (migrations, DDL) apart from the API's role and the workers' role,
which may only read and write rows, and the workers' not even read tokens or sessions.

Owns :func:`grant` (run by ``compilesvc migrate --grant-api ROLE --grant-worker ROLE`` after upgrading, so
tables a migration adds are granted at once; GRANT and REVOKE are idempotent) and :data:`WORKER_DENIED`.
The roles themselves are made once by the database's administrator (docker/postgres/roles.sh in compose).

Why these lines: a worker runs compiles, which are untrusted code; whatever reaches the worker's
credentials must not mint or read API tokens, hijack UI sessions or replay idempotent answers, and no
application role may change the schema (PostgreSQL 15 no longer lets every role create in ``public``).
"""

from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.engine import Engine

#: Tables the workers' role cannot read or write: who may call the API, and its sessions and replays.
WORKER_DENIED = ("api_tokens", "ui_sessions", "idempotency_keys")

_ROLE_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def statements(api_role: str, worker_role: str) -> list[str]:
    """The SQL :func:`grant` runs, in order."""
    for role in (api_role, worker_role):
        if not _ROLE_RE.match(role):
            raise ValueError(f"{role!r} is not a plain role name (lower-case letters, digits, _)")
    out = []
    for role in (api_role, worker_role):
        out += [f"GRANT USAGE ON SCHEMA public TO {role}",
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
                f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
                # Reading the schema version is allowed (readiness checks); moving it is the owner's.
                f"REVOKE INSERT, UPDATE, DELETE ON alembic_version FROM {role}",
                f"REVOKE CREATE ON SCHEMA public FROM {role}"]
    out += [f"REVOKE ALL ON {table} FROM {worker_role}" for table in WORKER_DENIED]
    return out


def grant(engine: Engine, api_role: str, worker_role: str) -> None:
    """Grant the two roles their rights on every table there is now (Postgres only)."""
    if engine.dialect.name != "postgresql":
        raise ValueError("ledger roles are a Postgres feature; SQLite has no users")
    with engine.begin() as connection:
        for statement in statements(api_role, worker_role):
            connection.execute(text(statement))
