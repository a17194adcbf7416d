"""pin jobs: a large S3 model object hashed in the background for its pin, once across every API process
(compilesvc/pinning/hash_jobs.py): one row per object identity (uri, version id, ETag, size, as model_pins),
claimed with a lease its hasher renews, with the bytes read so far for the submits that wait on it

Revision ID: 0024_pin_jobs
Revises: 0023_campaign_resume
Create Date: 2026-11-26 20:15:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0024_pin_jobs'
down_revision: str | None = '0023_campaign_resume'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'pin_jobs',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('uri', sa.String(length=1024), nullable=False),
        sa.Column('version_id', sa.String(length=1024), nullable=False),
        sa.Column('etag', sa.String(length=255), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('bytes_done', sa.BigInteger(), nullable=False),
        sa.Column('owner', sa.String(length=255), nullable=True),
        sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('sha256', sa.String(length=64), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('store_failures', sa.Integer(), server_default='0', nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_pin_jobs')),
        sa.UniqueConstraint('uri', 'version_id', 'etag', 'size', name=op.f('uq_pin_jobs_uri_version_id_etag_size')),
    )


def downgrade() -> None:
    op.drop_table('pin_jobs')
