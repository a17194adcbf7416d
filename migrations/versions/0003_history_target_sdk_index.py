"""builds: index (target, sdk, id) for history filtered by target and SDK together

Revision ID: 0003_history
Revises: 0002_history
Create Date: 2026-11-21 14:25:00.000000

Target and SDK are the two filters the history UI offers side by side, and SDK releases follow time. With
only the single-column indexes, "target=inf2 and sdk=<an old release>" intersects the inf2 index (half of
all builds) with the SDK index and reads inf2 entries down to where that release was last used: ~30 ms at a
million builds, growing with the table. With this index it is a walk of exactly one page.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0003_history'
down_revision: str | None = '0002_history'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = 'ix_builds_target_sdk_id'


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        # As in 0002: don't block submits while the index builds; clear an INVALID leftover first.
        with op.get_context().autocommit_block():
            op.drop_index(INDEX, table_name='builds', postgresql_concurrently=True, if_exists=True)
            op.create_index(INDEX, 'builds', ['target', 'sdk', 'id'], unique=False,
                            postgresql_concurrently=True)
    else:
        with op.batch_alter_table('builds', schema=None) as batch_op:
            batch_op.create_index(INDEX, ['target', 'sdk', 'id'], unique=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            op.drop_index(INDEX, table_name='builds', postgresql_concurrently=True, if_exists=True)
    else:
        with op.batch_alter_table('builds', schema=None) as batch_op:
            batch_op.drop_index(INDEX)
