"""stats indexes: the Stats page's windows read compiles by finish and start time (with the queued time, for
waits from the index alone), failures by time, and builds' outcomes by creation time from the index alone
(replacing the plain created_at index, which nothing else reads)

Revision ID: 0014_stats_indexes
Revises: 0013_provenance
Create Date: 2026-11-26 18:30:00.000000
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0014_stats_indexes'
down_revision: str | None = '0013_provenance'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_index('ix_builds_created_at')
        batch_op.create_index('ix_builds_created_at_outcome_buckets_reused',
                              ['created_at', 'outcome', 'buckets_reused'], unique=False)
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.create_index('ix_bucket_compiles_finished_at', ['finished_at'], unique=False)
        batch_op.create_index('ix_bucket_compiles_started_at_queued_at', ['started_at', 'queued_at'], unique=False)
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.create_index('ix_bucket_failures_at', ['at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('bucket_failures', schema=None) as batch_op:
        batch_op.drop_index('ix_bucket_failures_at')
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.drop_index('ix_bucket_compiles_started_at_queued_at')
        batch_op.drop_index('ix_bucket_compiles_finished_at')
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_index('ix_builds_created_at_outcome_buckets_reused')
        batch_op.create_index('ix_builds_created_at', ['created_at'], unique=False)
