"""policy campaign once: at most one campaign per (roll-forward policy, release), so a relay that starts a
run whose worker died (compilesvc/lifecycle/policies.py, start_stalled) and a slow worker, or two relays, can
never both start it: the second insert fails and the run names the first campaign

Revision ID: 0020_policy_campaign_once
Revises: 0019_rollforward_policies
Create Date: 2026-11-26 18:00:00.000000

A plain CREATE INDEX: campaigns is a small table (one row per roll-forward). 0019 made policy runs unique per
(policy, release) and only a run starts a policy's campaign, so no ledger holds duplicates to refuse it.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0020_policy_campaign_once'
down_revision: str | None = '0019_rollforward_policies'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = 'uq_campaigns_policy_id_to_sdk'
OF_A_POLICY = sa.text('policy_id IS NOT NULL')


def upgrade() -> None:
    op.create_index(NAME, 'campaigns', ['policy_id', 'to_sdk'], unique=True, postgresql_where=OF_A_POLICY,
                    sqlite_where=OF_A_POLICY)


def downgrade() -> None:
    op.drop_index(NAME, table_name='campaigns')
