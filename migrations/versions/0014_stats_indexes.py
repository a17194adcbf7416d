"""stats and browse indexes: the Stats page's windows read compiles by finish and start time (with the queued
time, for waits from the index alone), failures by time, and builds' outcomes by creation time from the
index alone (replacing the plain created_at index, which nothing else reads); the artifacts page finds a
model's artifacts by sha256, and a build's artifact's newest builds by (artifact_id, id)

Revision ID: 0014_stats_indexes
Revises: 0013_provenance
Create Date: 2026-11-26 18:30:00.000000

On Postgres the indexes are built CONCURRENTLY (as in 0002): a plain CREATE INDEX holds a lock that blocks
every submit, lease update and failure write for as long as a million-row index takes to build.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0014_stats_indexes'
down_revision: str | None = '0013_provenance'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (table, index, columns) created by this migration.
CREATED = [
    ('builds', 'ix_builds_created_at_outcome_reuse', ['created_at', 'outcome', 'buckets_reused', 'buckets_compiled']),
    ('builds', 'ix_builds_artifact_id_id', ['artifact_id', 'id']),
    ('bucket_compiles', 'ix_bucket_compiles_finished_at', ['finished_at']),
    ('bucket_compiles', 'ix_bucket_compiles_started_at_queued_at', ['started_at', 'queued_at']),
    ('bucket_failures', 'ix_bucket_failures_at', ['at']),
    ('artifacts', 'ix_artifacts_model_sha256', ['model_sha256']),
]
#: (table, index, columns) replaced by the ones above.
DROPPED = [
    ('builds', 'ix_builds_created_at', ['created_at']),
    ('builds', 'ix_builds_artifact_id', ['artifact_id']),
]


def _create(specs: list[tuple[str, str, list[str]]]) -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            for table, name, columns in specs:
                # An INVALID leftover of an interrupted concurrent build is dropped first.
                op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
                op.create_index(name, table, columns, unique=False, postgresql_concurrently=True)
    else:
        for table, name, columns in specs:
            op.create_index(name, table, columns, unique=False)


def _drop(specs: list[tuple[str, str, list[str]]]) -> None:
    if op.get_bind().dialect.name == 'postgresql':
        with op.get_context().autocommit_block():
            for table, name, _ in specs:
                op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
    else:
        for table, name, _ in specs:
            op.drop_index(name, table_name=table)


def upgrade() -> None:
    _create(CREATED)
    _drop(DROPPED)


def downgrade() -> None:
    _create(DROPPED)
    _drop(CREATED)
