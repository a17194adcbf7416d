"""scaler index: KEDA polls every pool's queued and running compiles every few seconds (the chart's scaler
query, deploy/helm/compilesvc/templates/_helpers.tpl); a partial index on (queue, state) of the active compiles
answers it from the index alone, whatever the size of the history (bench/scaler_query.py)

Revision ID: 0017_scaler_index
Revises: 0016_ui_sessions
Create Date: 2026-11-26 16:00:00.000000

Built CONCURRENTLY on Postgres (as 0014): a plain CREATE INDEX would block every submit and lease update while
it reads the table.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017_scaler_index'
down_revision: str | None = '0016_ui_sessions'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = 'ix_bucket_compiles_active_queue'
ACTIVE = sa.text("state IN ('queued', 'running')")


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            op.drop_index(NAME, table_name='bucket_compiles', postgresql_concurrently=True, if_exists=True)
            op.create_index(NAME, 'bucket_compiles', ['queue', 'state'], postgresql_where=ACTIVE,
                            postgresql_concurrently=True)
    else:
        op.create_index(NAME, 'bucket_compiles', ['queue', 'state'], sqlite_where=ACTIVE)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            op.drop_index(NAME, table_name='bucket_compiles', postgresql_concurrently=True, if_exists=True)
    else:
        op.drop_index(NAME, table_name='bucket_compiles')
