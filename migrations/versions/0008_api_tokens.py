"""API tokens, per-token idempotency keys, and who submitted a build

Revision ID: 0008_api_tokens
Revises: 0007_attempt_rounds
Create Date: 2026-11-25 13:40:00.000000

``api_tokens`` holds tokens by the sha256 of their secret. A build records the token that submitted it
and that token's team (who may cancel and retry it). Idempotency keys move from a global unique column on
``builds`` to ``idempotency_keys``, scoped per token and expiring: builds submitted before this revision
keep their ``idempotency_key`` as history, but no longer replay (they have no token). The downgrade
restores the global unique constraint, keeping each key on its oldest build only.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008_api_tokens'
down_revision: str | None = '0007_attempt_rounds'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('owner', sa.String(length=255), nullable=False),
    sa.Column('team', sa.String(length=255), nullable=False),
    sa.Column('scopes', JSON, nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('hint', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=255), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_id', BIG_ID, nullable=True))
        batch_op.add_column(sa.Column('team', sa.String(length=255), nullable=True))
        batch_op.drop_constraint('uq_builds_idempotency_key', type_='unique')
        batch_op.create_foreign_key(batch_op.f('fk_builds_token_id_api_tokens'), 'api_tokens', ['token_id'], ['id'])
        batch_op.create_index('ix_builds_token_id_state', ['token_id', 'state'], unique=False)
    op.create_table('idempotency_keys',
    sa.Column('token_id', BIG_ID, nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('build_id', BIG_ID, nullable=False),
    sa.Column('status', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_idempotency_keys_build_id_builds'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], name=op.f('fk_idempotency_keys_token_id_api_tokens'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('token_id', 'key', name=op.f('pk_idempotency_keys'))
    )
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.create_index('ix_idempotency_keys_created_at', ['created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.drop_index('ix_idempotency_keys_created_at')
    op.drop_table('idempotency_keys')
    # Several tokens may have used one key: it stays on its oldest build, so the global constraint holds.
    op.execute(
        "UPDATE builds SET idempotency_key = NULL WHERE idempotency_key IS NOT NULL AND id NOT IN "
        "(SELECT MIN(id) FROM builds WHERE idempotency_key IS NOT NULL GROUP BY idempotency_key)"
    )
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_index('ix_builds_token_id_state')
        batch_op.drop_constraint(batch_op.f('fk_builds_token_id_api_tokens'), type_='foreignkey')
        batch_op.create_unique_constraint(batch_op.f('uq_builds_idempotency_key'), ['idempotency_key'])
        batch_op.drop_column('team')
        batch_op.drop_column('token_id')
    op.drop_table('api_tokens')
