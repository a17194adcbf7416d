"""campaign item claims: an item's submit is claimed (a conditional update setting submit_claimed_at) before
it is made, so the relay that resumes a campaign whose starter died mid-loop (compilesvc/lifecycle/campaigns.py,
submit_items) and a slow starter, or two relays, submit each item once

Revision ID: 0021_campaign_item_claims
Revises: 0020_policy_campaign_once
Create Date: 2026-11-26 18:45:00.000000

A nullable column, no default: existing items read as never claimed, which is what an item with neither a
build nor a refusal is.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0021_campaign_item_claims'
down_revision: str | None = '0020_policy_campaign_once'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('campaign_items', sa.Column('submit_claimed_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('campaign_items', 'submit_claimed_at')
