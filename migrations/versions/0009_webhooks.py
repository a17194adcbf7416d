"""webhooks: callback URLs per build, their deliveries and every try

Revision ID: 0009_webhooks
Revises: 0008_api_tokens
Create Date: 2026-11-25 14:10:00.000000

A build's callback URLs (``webhooks``) get one delivery per terminal state it reaches
(``webhook_deliveries``, written in the transaction that ends the build), which the relay sends with
retries, recording each try (``webhook_attempts``).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009_webhooks'
down_revision: str | None = '0008_api_tokens'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('webhooks',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('build_id', BIG_ID, nullable=False),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_webhooks_build_id_builds'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhooks'))
    )
    with op.batch_alter_table('webhooks', schema=None) as batch_op:
        batch_op.create_index('ix_webhooks_build_id', ['build_id'], unique=False)
    op.create_table('webhook_deliveries',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('webhook_id', BIG_ID, nullable=False),
    sa.Column('build_id', BIG_ID, nullable=False),
    sa.Column('event', sa.String(length=32), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('payload', sa.Text(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_status', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_webhook_deliveries_build_id_builds'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['webhook_id'], ['webhooks.id'], name=op.f('fk_webhook_deliveries_webhook_id_webhooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries'))
    )
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.create_index('ix_webhook_deliveries_build_id', ['build_id'], unique=False)
        batch_op.create_index('ix_webhook_deliveries_due', ['next_attempt_at'], unique=False,
                              postgresql_where=sa.text("state = 'pending'"), sqlite_where=sa.text("state = 'pending'"))
    op.create_table('webhook_attempts',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('delivery_id', BIG_ID, nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('duration_ms', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['delivery_id'], ['webhook_deliveries.id'], name=op.f('fk_webhook_attempts_delivery_id_webhook_deliveries'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_attempts'))
    )
    with op.batch_alter_table('webhook_attempts', schema=None) as batch_op:
        batch_op.create_index('ix_webhook_attempts_delivery_id', ['delivery_id'], unique=False)


def downgrade() -> None:
    for table, indexes in (('webhook_attempts', ['ix_webhook_attempts_delivery_id']),
                           ('webhook_deliveries', ['ix_webhook_deliveries_due', 'ix_webhook_deliveries_build_id']),
                           ('webhooks', ['ix_webhooks_build_id'])):
        with op.batch_alter_table(table, schema=None) as batch_op:
            for index in indexes:
                batch_op.drop_index(index)
        op.drop_table(table)
