"""ui sessions: one row per UI login, so logout and token revocation end it on the server

Revision ID: 0016_ui_sessions
Revises: 0015_builds_team_index
Create Date: 2026-11-26 09:00:00.000000

Sessions made before this migration named their token in the cookie only; they end here (their users log
in again), since no row can be made for a cookie the server never saw.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016_ui_sessions'
down_revision: str | None = '0015_builds_team_index'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('ui_sessions',
    sa.Column('id_hash', sa.String(length=64), nullable=False),
    sa.Column('token_id', BIG_ID, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], name=op.f('fk_ui_sessions_token_id_api_tokens'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id_hash', name=op.f('pk_ui_sessions'))
    )
    with op.batch_alter_table('ui_sessions', schema=None) as batch_op:
        batch_op.create_index('ix_ui_sessions_expires_at', ['expires_at'], unique=False)
        batch_op.create_index('ix_ui_sessions_token_id', ['token_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('ui_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_ui_sessions_token_id')
        batch_op.drop_index('ix_ui_sessions_expires_at')
    op.drop_table('ui_sessions')
