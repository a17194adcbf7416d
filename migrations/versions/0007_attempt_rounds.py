"""attempt rounds: failures count per round of attempts

Revision ID: 0007_attempt_rounds
Revises: 0006_toolchain_queues
Create Date: 2026-11-24 00:40:00.000000

A resubmit or an explicit retry resets a compile's attempts and starts a new round
(``bucket_compiles.attempt_round``); each failure records the round it happened in, so the bounded retries
of unknown failures count only the current round's. Existing rows are round 0.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007_attempt_rounds'
down_revision: str | None = '0006_toolchain_queues'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ('bucket_compiles', 'bucket_failures')


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('attempt_round', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('attempt_round')
