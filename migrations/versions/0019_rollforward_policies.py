"""rollforward policies: standing roll-forwards, the SDK releases workers registered with (filled from the
workers seen so far, so only a release none of them had is new), each policy's run per release, a campaign's
policy, and the campaign.started event

Revision ID: 0019_rollforward_policies
Revises: 0018_drain
Create Date: 2026-11-26 16:05:00.000000
"""
import json
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0019_rollforward_policies'
down_revision: str | None = '0018_drain'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
EVENTS_BEFORE = "event IN ('artifact.published', 'build.failed', 'campaign.finished')"
EVENTS_AFTER = "event IN ('artifact.published', 'build.failed', 'campaign.finished', 'campaign.started')"


def upgrade() -> None:
    op.create_table('rollforward_policies',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('target', sa.String(length=16), nullable=True),
    sa.Column('from_sdk', sa.String(length=32), nullable=True),
    sa.Column('model', sa.String(length=255), nullable=True),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('pinned', sa.Boolean(), nullable=False),
    sa.Column('fetched_within_days', sa.Double(), nullable=True),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('created_by', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollforward_policies')),
    sa.UniqueConstraint('name', name=op.f('uq_rollforward_policies_name'))
    )
    op.create_table('sdk_releases',
    sa.Column('target', sa.String(length=16), nullable=False),
    sa.Column('sdk', sa.String(length=32), nullable=False),
    sa.Column('first_worker_id', sa.String(length=255), nullable=False),
    sa.Column('first_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('target', 'sdk', name=op.f('pk_sdk_releases'))
    )
    op.create_table('rollforward_policy_runs',
    sa.Column('id', BIG_ID, nullable=False),
    sa.Column('policy_id', BIG_ID, nullable=False),
    sa.Column('to_sdk', sa.String(length=32), nullable=False),
    sa.Column('target', sa.String(length=16), nullable=False),
    sa.Column('worker_id', sa.String(length=255), nullable=False),
    sa.Column('from_sdk', sa.String(length=32), nullable=True),
    sa.Column('campaign_id', BIG_ID, nullable=True),
    sa.Column('note', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['campaign_id'], ['campaigns.id'], name=op.f('fk_rollforward_policy_runs_campaign_id_campaigns'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['policy_id'], ['rollforward_policies.id'], name=op.f('fk_rollforward_policy_runs_policy_id_rollforward_policies'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollforward_policy_runs')),
    sa.UniqueConstraint('policy_id', 'to_sdk', name=op.f('uq_rollforward_policy_runs_policy_id_to_sdk'))
    )
    with op.batch_alter_table('rollforward_policy_runs', schema=None) as batch_op:
        batch_op.create_index('ix_rollforward_policy_runs_campaign_id', ['campaign_id'], unique=False)
    with op.batch_alter_table('campaigns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('policy_id', BIG_ID, nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_campaigns_policy_id_rollforward_policies'), 'rollforward_policies', ['policy_id'], ['id'], ondelete='SET NULL')
    with op.batch_alter_table('event_subscriptions', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_event_subscriptions_event'), type_='check')
        batch_op.create_check_constraint('event', EVENTS_AFTER)
    _seen_so_far()


def _seen_so_far() -> None:
    """Every (target, release) a worker already registered with is not new: a policy added now fires for the
    next release, not for the fleet's current one."""
    bind = op.get_bind()
    seen: dict[tuple[str, str], str] = {}
    for worker_id, capabilities in bind.execute(sa.text("SELECT id, capabilities FROM workers ORDER BY started_at")):
        caps = json.loads(capabilities) if isinstance(capabilities, str) else (capabilities or {})
        for target in caps.get('targets') or []:
            sdk = (caps.get('sdk') or {}).get(target)
            if sdk:
                seen.setdefault((target, str(sdk)), worker_id)
    if seen:
        table = sa.table('sdk_releases', sa.column('target'), sa.column('sdk'), sa.column('first_worker_id'),
                         sa.column('first_seen_at', sa.DateTime(timezone=True)))
        now = datetime.now(UTC)
        op.bulk_insert(table, [{'target': t, 'sdk': s, 'first_worker_id': w, 'first_seen_at': now}
                               for (t, s), w in seen.items()])


def downgrade() -> None:
    op.execute("DELETE FROM event_subscriptions WHERE event = 'campaign.started'")
    with op.batch_alter_table('event_subscriptions', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_event_subscriptions_event'), type_='check')
        batch_op.create_check_constraint('event', EVENTS_BEFORE)
    with op.batch_alter_table('campaigns', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_campaigns_policy_id_rollforward_policies'), type_='foreignkey')
        batch_op.drop_column('policy_id')
    with op.batch_alter_table('rollforward_policy_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_rollforward_policy_runs_campaign_id')
    op.drop_table('rollforward_policy_runs')
    op.drop_table('sdk_releases')
    op.drop_table('rollforward_policies')
