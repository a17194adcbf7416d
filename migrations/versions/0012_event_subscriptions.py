"""event subscriptions: URLs notified service-wide of artifact.published, build.failed and
campaign.finished, delivered through webhook_deliveries (which now hold a build's own webhooks or a
subscription's events)

Revision ID: 0012_event_subscriptions
Revises: 0011_retention
Create Date: 2026-11-25 15:42:16.558992
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012_event_subscriptions'
down_revision: str | None = '0011_retention'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('event_subscriptions',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('event', sa.String(length=32), nullable=False),
    sa.Column('created_by', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("event IN ('artifact.published', 'build.failed', 'campaign.finished')", name=op.f('ck_event_subscriptions_event')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_event_subscriptions')),
    sa.UniqueConstraint('url', 'event', name=op.f('uq_event_subscriptions_url_event'))
    )
    with op.batch_alter_table('event_subscriptions', schema=None) as batch_op:
        batch_op.create_index('ix_event_subscriptions_event', ['event'], unique=False)

    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.add_column(sa.Column('subscription_id', BIG_ID, nullable=True))
        batch_op.add_column(sa.Column('subject_id', sa.BigInteger(), nullable=True))
        batch_op.alter_column('webhook_id',
               existing_type=BIG_ID,
               nullable=True)
        batch_op.alter_column('build_id',
               existing_type=BIG_ID,
               nullable=True)
        batch_op.create_foreign_key(batch_op.f('fk_webhook_deliveries_subscription_id_event_subscriptions'), 'event_subscriptions', ['subscription_id'], ['id'], ondelete='CASCADE')



def downgrade() -> None:
    op.execute(sa.text("DELETE FROM webhook_deliveries WHERE webhook_id IS NULL"))  # subscriptions' events
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_webhook_deliveries_subscription_id_event_subscriptions'), type_='foreignkey')
        batch_op.alter_column('build_id',
               existing_type=BIG_ID,
               nullable=False)
        batch_op.alter_column('webhook_id',
               existing_type=BIG_ID,
               nullable=False)
        batch_op.drop_column('subject_id')
        batch_op.drop_column('subscription_id')

    with op.batch_alter_table('event_subscriptions', schema=None) as batch_op:
        batch_op.drop_index('ix_event_subscriptions_event')

    op.drop_table('event_subscriptions')
