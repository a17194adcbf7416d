"""builds: index (submitted_by, id) for the history filter submitted_by=...

Revision ID: 0002_history
Revises: 0001
Create Date: 2026-11-21 14:10:00.000000

Without it, ``list_builds(submitted_by=...)`` walks the primary key backwards and filters every row until it
has a page: a full scan of ``builds`` for a user with few or no builds.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0002_history'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = 'ix_builds_submitted_by_id'


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        # builds is the largest and busiest table: build the index without blocking submits. CONCURRENTLY
        # cannot run in a transaction, and a failed attempt leaves an INVALID index behind, dropped first.
        with op.get_context().autocommit_block():
            op.drop_index(INDEX, table_name='builds', postgresql_concurrently=True, if_exists=True)
            op.create_index(INDEX, 'builds', ['submitted_by', 'id'], unique=False,
                            postgresql_concurrently=True)
    else:
        with op.batch_alter_table('builds', schema=None) as batch_op:
            batch_op.create_index(INDEX, ['submitted_by', 'id'], unique=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            op.drop_index(INDEX, table_name='builds', postgresql_concurrently=True, if_exists=True)
    else:
        with op.batch_alter_table('builds', schema=None) as batch_op:
            batch_op.drop_index(INDEX)
