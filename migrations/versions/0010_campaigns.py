"""campaigns: roll-forwards of artifacts to another SDK release

Revision ID: 0010_campaigns
Revises: 0009_webhooks
Create Date: 2026-11-25 15:20:21.802520

An operator's roll-forward (``campaigns``) of every selected artifact of one Neuron SDK release to another,
one ``campaign_items`` row per artifact: the build whose spec it resubmits and the build it started.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0010_campaigns'
down_revision: str | None = '0009_webhooks'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('campaigns',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('from_sdk', sa.String(length=32), nullable=False),
    sa.Column('to_sdk', sa.String(length=32), nullable=False),
    sa.Column('selection', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_by', sa.String(length=255), nullable=True),
    sa.Column('team', sa.String(length=255), nullable=True),
    sa.Column('token_id', BIG_ID, nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('running', 'finished')", name=op.f('ck_campaigns_state')),
    sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], name=op.f('fk_campaigns_token_id_api_tokens')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_campaigns'))
    )
    with op.batch_alter_table('campaigns', schema=None) as batch_op:
        batch_op.create_index('ix_campaigns_state', ['state'], unique=False)

    op.create_table('campaign_items',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('campaign_id', BIG_ID, nullable=False),
    sa.Column('source_key', sa.String(length=64), nullable=False),
    sa.Column('source_build_id', BIG_ID, nullable=False),
    sa.Column('build_id', BIG_ID, nullable=True),
    sa.Column('refusal', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_campaign_items_build_id_builds')),
    sa.ForeignKeyConstraint(['campaign_id'], ['campaigns.id'], name=op.f('fk_campaign_items_campaign_id_campaigns'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['source_build_id'], ['builds.id'], name=op.f('fk_campaign_items_source_build_id_builds')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_campaign_items')),
    sa.UniqueConstraint('campaign_id', 'source_key', name=op.f('uq_campaign_items_campaign_id_source_key'))
    )
    with op.batch_alter_table('campaign_items', schema=None) as batch_op:
        batch_op.create_index('ix_campaign_items_build_id', ['build_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('campaign_items', schema=None) as batch_op:
        batch_op.drop_index('ix_campaign_items_build_id')

    op.drop_table('campaign_items')
    with op.batch_alter_table('campaigns', schema=None) as batch_op:
        batch_op.drop_index('ix_campaigns_state')

    op.drop_table('campaigns')
