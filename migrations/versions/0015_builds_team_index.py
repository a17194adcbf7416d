"""builds (team, id) index: under the team boundary for reads (COMPILESVC_TEAM_READS) a non-admin's history
is one more keyset stream, a team's builds newest first (compilesvc.insights.history, compilesvc.access.team_reads); without
the index a small team's page walks every team's newest builds to fill

Revision ID: 0015_builds_team_index
Revises: 0014_stats_indexes
Create Date: 2026-11-26 09:00:00.000000

Built CONCURRENTLY on Postgres, as 0014: a plain CREATE INDEX would block every submit while it builds.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0015_builds_team_index'
down_revision: str | None = '0014_stats_indexes'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME, TABLE, COLUMNS = 'ix_builds_team_id', 'builds', ['team', 'id']


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            # An INVALID leftover of an interrupted concurrent build is dropped first.
            op.drop_index(NAME, table_name=TABLE, postgresql_concurrently=True, if_exists=True)
            op.create_index(NAME, TABLE, COLUMNS, unique=False, postgresql_concurrently=True)
    else:
        op.create_index(NAME, TABLE, COLUMNS, unique=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            op.drop_index(NAME, table_name=TABLE, postgresql_concurrently=True, if_exists=True)
    else:
        op.drop_index(NAME, table_name=TABLE)
