"""Alembic environment: migrates the ledger at the URL given by compilesvc (or COMPILESVC_DATABASE_URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import make_engine, normalise_url
from compilesvc.ledger.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return normalise_url(url or Settings().resolved_database_url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # SQLite ALTERs go through batch mode: copy the table, DROP the original, rename the copy. With
            # foreign keys enforced (compilesvc's engines turn them on), that DROP would delete every row
            # referencing the table (ON DELETE CASCADE) or fail. SQLite's own recipe for schema changes: keep
            # them off for the migration (only possible outside a transaction), check the result after.
            conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration left rows with dangling foreign keys: {broken[:5]}")
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
