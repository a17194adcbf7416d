"""checkpoint pins: an uploaded checkpoint archive's key material (config.json, weight digests) remembered by
its blob's sha256, so a submit of it reads nothing from the store the second time (compilesvc/pinning/checkpoints.py)

Revision ID: 0022_checkpoint_pins
Revises: 0021_campaign_item_claims
Create Date: 2026-11-26 19:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0022_checkpoint_pins'
down_revision: str | None = '0021_campaign_item_claims'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'checkpoint_pins',
        sa.Column('blob_sha256', sa.String(length=64), nullable=False),
        sa.Column('material', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('blob_sha256', name=op.f('pk_checkpoint_pins')),
    )


def downgrade() -> None:
    op.drop_table('checkpoint_pins')
