"""state CHECK constraints; bucket_failures (every failed step, first cause first); outbox.available_at
and an index for a compile's latest dispatch

Revision ID: 0004_states
Revises: 0003_history
Create Date: 2026-11-23 10:20:00.000000

The CHECKs list the states of compilesvc/states.py as they were at this revision (a migration is a
snapshot: a later change of the enums needs a migration of its own). ``available_at`` delays the send of an
outbox row: the backoff before an infrastructure retry.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004_states'
down_revision: str | None = '0003_history'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ERROR_CLASSES = "'compile', 'model', 'infra', 'timeout', 'cancelled'"
CHECKS = {
    'artifacts': {'state': "state IN ('building', 'published', 'failed', 'cancelled')"},
    'bucket_compiles': {'state': "state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                        'error_class': f"error_class IN ({ERROR_CLASSES})"},
    'builds': {'state': "state IN ('building', 'succeeded', 'failed', 'cancelled')",
               'outcome': "outcome IN ('hit', 'join', 'new')"},
}


def upgrade() -> None:
    op.create_table(
        'bucket_failures',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('bucket_compile_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('phase', sa.String(length=16), nullable=False),
        sa.Column('error_class', sa.String(length=16), nullable=False),
        sa.Column('code', sa.String(length=64), nullable=True),
        sa.Column('message', sa.Text(), nullable=True),
        sa.Column('retry', sa.Boolean(), nullable=False),
        sa.CheckConstraint(f"error_class IN ({ERROR_CLASSES})", name=op.f('ck_bucket_failures_error_class')),
        sa.ForeignKeyConstraint(['bucket_compile_id'], ['bucket_compiles.id'],
                                name=op.f('fk_bucket_failures_bucket_compile_id_bucket_compiles'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_bucket_failures')),
    )
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.create_index('ix_bucket_failures_bucket_compile_id_id', ['bucket_compile_id', 'id'], unique=False)
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.add_column(sa.Column('available_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_outbox_bucket_compile_id_id', ['bucket_compile_id', 'id'], unique=False)
    for table, checks in CHECKS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name, condition in checks.items():
                batch_op.create_check_constraint(op.f(f'ck_{table}_{name}'), condition)


def downgrade() -> None:
    for table, checks in CHECKS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name in checks:
                batch_op.drop_constraint(op.f(f'ck_{table}_{name}'), type_='check')
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index('ix_outbox_bucket_compile_id_id')
        batch_op.drop_column('available_at')
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.drop_index('ix_bucket_failures_bucket_compile_id_id')
    op.drop_table('bucket_failures')
