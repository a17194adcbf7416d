"""retention: pins, garbage-collection runs and what they deleted, a deleted state for artifacts and
bucket compiles, and when each artifact was last fetched

Revision ID: 0011_retention
Revises: 0010_campaigns
Create Date: 2026-11-25 15:34:17.800794
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0011_retention'
down_revision: str | None = '0010_campaigns'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
# The state columns' CHECKs gain 'deleted' (compilesvc.states).
STATES = {
    'artifacts': ("'building', 'published', 'failed', 'cancelled'",
                  "'building', 'published', 'failed', 'cancelled', 'deleted'"),
    'bucket_compiles': ("'queued', 'running', 'succeeded', 'failed', 'cancelled'",
                        "'queued', 'running', 'succeeded', 'failed', 'cancelled', 'deleted'"),
}


def _replace_state_checks(which: int) -> None:
    for table, values in STATES.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f'ck_{table}_state'), type_='check')
            batch_op.create_check_constraint(op.f(f'ck_{table}_state'), f"state IN ({values[which]})")


def upgrade() -> None:
    op.create_table('gc_runs',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('dry_run', sa.Boolean(), nullable=False),
    sa.Column('started_by', sa.String(length=255), nullable=True),
    sa.Column('policy', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('artifacts', sa.Integer(), nullable=False),
    sa.Column('documents', sa.Integer(), nullable=False),
    sa.Column('blobs', sa.Integer(), nullable=False),
    sa.Column('bytes_freed', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gc_runs'))
    )
    op.create_table('retention_pins',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('value', sa.String(length=1100), nullable=False),
    sa.Column('note', sa.Text(), nullable=True),
    sa.Column('created_by', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("kind IN ('artifact', 'model', 'label')", name=op.f('ck_retention_pins_kind')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_retention_pins')),
    sa.UniqueConstraint('kind', 'value', name=op.f('uq_retention_pins_kind_value'))
    )
    op.create_table('gc_deletions',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('run_id', BIG_ID, nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=1024), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('reason', sa.String(length=255), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['gc_runs.id'], name=op.f('fk_gc_deletions_run_id_gc_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gc_deletions'))
    )
    with op.batch_alter_table('gc_deletions', schema=None) as batch_op:
        batch_op.create_index('ix_gc_deletions_run_id', ['run_id'], unique=False)

    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_fetched_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('fetch_count', sa.BigInteger(), server_default='0', nullable=False))

    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))
    _replace_state_checks(1)


def downgrade() -> None:
    # A deleted artifact's files are gone: what it was before is not coming back. Downgrading keeps the
    # rows (history) as failed, which a resubmit rebuilds, as it would a deleted one.
    op.execute(sa.text("UPDATE artifacts SET state = 'failed' WHERE state = 'deleted'"))
    op.execute(sa.text("UPDATE bucket_compiles SET state = 'cancelled' WHERE state = 'deleted'"))
    _replace_state_checks(0)
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')

    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.drop_column('fetch_count')
        batch_op.drop_column('last_fetched_at')
        batch_op.drop_column('deleted_at')

    with op.batch_alter_table('gc_deletions', schema=None) as batch_op:
        batch_op.drop_index('ix_gc_deletions_run_id')

    op.drop_table('gc_deletions')
    op.drop_table('retention_pins')
    op.drop_table('gc_runs')
