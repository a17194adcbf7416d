"""provenance: which build queued each bucket compile (and its model name), and per build how it got each bucket (compiled,
joined, reused, a remembered failure, imported) and how many it reused and compiled; each failed attempt's
archived log. Compiles queued before it get the first new build of a set containing them as their origin

Revision ID: 0013_provenance
Revises: 0012_event_subscriptions
Create Date: 2026-11-25 18:30:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0013_provenance'
down_revision: str | None = '0012_event_subscriptions'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.add_column(sa.Column('origin_build_id', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('model_name', sa.String(length=200), nullable=True))
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.add_column(sa.Column('log_sha256', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('log_size', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('buckets_reused', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('buckets_compiled', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('provenance', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True))

    # Compiles queued before this migration: their origin is the first new build of a set containing them
    # (the one that created them), and its model name. Compiles only ever imported keep none.
    op.execute(BACKFILL)


BACKFILL = '''
UPDATE bucket_compiles SET
  origin_build_id = (SELECT min(b.id) FROM builds b JOIN artifact_buckets ab ON ab.artifact_id = b.artifact_id
                     WHERE ab.bucket_compile_id = bucket_compiles.id AND b.outcome = 'new'),
  model_name = (SELECT b.model_name FROM builds b JOIN artifact_buckets ab ON ab.artifact_id = b.artifact_id
                WHERE ab.bucket_compile_id = bucket_compiles.id AND b.outcome = 'new' ORDER BY b.id LIMIT 1)
WHERE started_at IS NOT NULL
'''


def downgrade() -> None:
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.drop_column('log_size')
        batch_op.drop_column('log_sha256')
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_column('provenance')
        batch_op.drop_column('buckets_compiled')
        batch_op.drop_column('buckets_reused')
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.drop_column('model_name')
        batch_op.drop_column('origin_build_id')
