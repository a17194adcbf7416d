"""drain: a worker's draining_at, and a compile's interruptions (attempts a draining worker gave back)

Revision ID: 0018_drain
Revises: 0017_scaler_index
Create Date: 2026-11-26 15:30:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0018_drain'
down_revision: str | None = '0017_scaler_index'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.add_column(sa.Column('interruptions', sa.Integer(), server_default='0', nullable=False))
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('draining_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('draining_at')
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.drop_column('interruptions')
