"""Schema migrations, run programmatically (``compilesvc migrate``, test fixtures, ``compilesvc dev``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations
from compilesvc.ledger.engine import normalise_url


def alembic_config(database_url: str) -> Config:
    script_location = Path(migrations.__file__).parent
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location))
    cfg.set_main_option("sqlalchemy.url", normalise_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
