"""initial ledger

Revision ID: 0001
Revises:
Create Date: 2026-11-21 13:49:39.021303
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table('artifacts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('target', sa.String(length=16), nullable=False),
    sa.Column('sdk', sa.String(length=32), nullable=False),
    sa.Column('backend', sa.String(length=32), nullable=False),
    sa.Column('model_sha256', sa.String(length=64), nullable=False),
    sa.Column('material', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('components', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('manifest_uri', sa.String(length=1024), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_artifacts')),
    sa.UniqueConstraint('key', name=op.f('uq_artifacts_key'))
    )
    op.create_table('bucket_compiles',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('target', sa.String(length=16), nullable=False),
    sa.Column('sdk', sa.String(length=32), nullable=False),
    sa.Column('backend', sa.String(length=32), nullable=False),
    sa.Column('queue', sa.String(length=128), nullable=False),
    sa.Column('model', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('material', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('inputs', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_token', sa.BigInteger(), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('worker_id', sa.String(length=255), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('error_class', sa.String(length=16), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('manifest_uri', sa.String(length=1024), nullable=True),
    sa.Column('versions', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('queued_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('compile_seconds', sa.Float(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_bucket_compiles')),
    sa.UniqueConstraint('key', name=op.f('uq_bucket_compiles_key'))
    )
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.create_index('ix_bucket_compiles_state_lease', ['state', 'lease_expires_at'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('entity', sa.String(length=16), nullable=False),
    sa.Column('entity_id', sa.BigInteger(), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('detail', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_entity_entity_id_id', ['entity', 'entity_id', 'id'], unique=False)

    op.create_table('model_pins',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('uri', sa.String(length=1024), nullable=False),
    sa.Column('version_id', sa.String(length=1024), nullable=False),
    sa.Column('etag', sa.String(length=255), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_pins')),
    sa.UniqueConstraint('uri', 'version_id', 'etag', 'size', name=op.f('uq_model_pins_uri_version_id_etag_size'))
    )
    op.create_table('workers',
    sa.Column('id', sa.String(length=255), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('capabilities', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('queues', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('slots', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_workers'))
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.create_index('ix_workers_heartbeat_at', ['heartbeat_at'], unique=False)

    op.create_table('artifact_buckets',
    sa.Column('artifact_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('bucket_compile_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['artifact_id'], ['artifacts.id'], name=op.f('fk_artifact_buckets_artifact_id_artifacts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['bucket_compile_id'], ['bucket_compiles.id'], name=op.f('fk_artifact_buckets_bucket_compile_id_bucket_compiles'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('artifact_id', 'bucket_compile_id', name=op.f('pk_artifact_buckets'))
    )
    with op.batch_alter_table('artifact_buckets', schema=None) as batch_op:
        batch_op.create_index('ix_artifact_buckets_bucket_compile_id', ['bucket_compile_id'], unique=False)

    op.create_table('builds',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('artifact_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('artifact_key', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('outcome', sa.String(length=8), nullable=False),
    sa.Column('submitted_by', sa.String(length=255), nullable=True),
    sa.Column('labels', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('spec', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=True),
    sa.Column('model_sha256', sa.String(length=64), nullable=False),
    sa.Column('target', sa.String(length=16), nullable=False),
    sa.Column('sdk', sa.String(length=32), nullable=False),
    sa.Column('backend', sa.String(length=32), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['artifact_id'], ['artifacts.id'], name=op.f('fk_builds_artifact_id_artifacts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_builds')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_builds_idempotency_key'))
    )
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.create_index('ix_builds_artifact_id', ['artifact_id'], unique=False)
        batch_op.create_index('ix_builds_created_at', ['created_at'], unique=False)
        batch_op.create_index('ix_builds_model_name_id', ['model_name', 'id'], unique=False)
        batch_op.create_index('ix_builds_model_sha256_id', ['model_sha256', 'id'], unique=False)
        batch_op.create_index('ix_builds_sdk_id', ['sdk', 'id'], unique=False)
        batch_op.create_index('ix_builds_state_id', ['state', 'id'], unique=False)
        batch_op.create_index('ix_builds_target_id', ['target', 'id'], unique=False)

    op.create_table('log_lines',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('bucket_compile_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stream', sa.String(length=16), nullable=False),
    sa.Column('line', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['bucket_compile_id'], ['bucket_compiles.id'], name=op.f('fk_log_lines_bucket_compile_id_bucket_compiles'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_log_lines'))
    )
    with op.batch_alter_table('log_lines', schema=None) as batch_op:
        batch_op.create_index('ix_log_lines_bucket_compile_id_id', ['bucket_compile_id', 'id'], unique=False)

    op.create_table('outbox',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('bucket_compile_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('task_name', sa.String(length=128), nullable=False),
    sa.Column('task_id', sa.String(length=128), nullable=False),
    sa.Column('kwargs', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('send_attempts', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['bucket_compile_id'], ['bucket_compiles.id'], name=op.f('fk_outbox_bucket_compile_id_bucket_compiles'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox')),
    sa.UniqueConstraint('task_id', name=op.f('uq_outbox_task_id'))
    )
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index('ix_outbox_unsent', ['id'], unique=False, postgresql_where=sa.text('sent_at IS NULL'), sqlite_where=sa.text('sent_at IS NULL'))

    op.create_table('build_labels',
    sa.Column('build_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.String(length=1024), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_build_labels_build_id_builds'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('build_id', 'name', name=op.f('pk_build_labels'))
    )
    with op.batch_alter_table('build_labels', schema=None) as batch_op:
        batch_op.create_index('ix_build_labels_name_value_build_id', ['name', 'value', 'build_id'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('build_labels', schema=None) as batch_op:
        batch_op.drop_index('ix_build_labels_name_value_build_id')

    op.drop_table('build_labels')
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index('ix_outbox_unsent', postgresql_where=sa.text('sent_at IS NULL'), sqlite_where=sa.text('sent_at IS NULL'))

    op.drop_table('outbox')
    with op.batch_alter_table('log_lines', schema=None) as batch_op:
        batch_op.drop_index('ix_log_lines_bucket_compile_id_id')

    op.drop_table('log_lines')
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_index('ix_builds_target_id')
        batch_op.drop_index('ix_builds_state_id')
        batch_op.drop_index('ix_builds_sdk_id')
        batch_op.drop_index('ix_builds_model_sha256_id')
        batch_op.drop_index('ix_builds_model_name_id')
        batch_op.drop_index('ix_builds_created_at')
        batch_op.drop_index('ix_builds_artifact_id')

    op.drop_table('builds')
    with op.batch_alter_table('artifact_buckets', schema=None) as batch_op:
        batch_op.drop_index('ix_artifact_buckets_bucket_compile_id')

    op.drop_table('artifact_buckets')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index('ix_workers_heartbeat_at')

    op.drop_table('workers')
    op.drop_table('model_pins')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_entity_entity_id_id')

    op.drop_table('events')
    with op.batch_alter_table('bucket_compiles', schema=None) as batch_op:
        batch_op.drop_index('ix_bucket_compiles_state_lease')

    op.drop_table('bucket_compiles')
    op.drop_table('artifacts')

