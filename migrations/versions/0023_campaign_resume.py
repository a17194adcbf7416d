"""campaign resume: a campaign records whether its submits queue while no worker serves the new release, so the
relay resuming an operator's campaign whose API request died mid-loop (compilesvc/lifecycle/resume.py) submits
its remaining items as the request would have

Revision ID: 0023_campaign_resume
Revises: 0022_checkpoint_pins
Create Date: 2026-11-26 20:30:00.000000

Existing campaigns: a policy's queued anyway (compilesvc/builds/policy_submits.py), an operator's is read as not
(the request's flag was not recorded; a resumed item then refused for want of a worker says so).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0023_campaign_resume'
down_revision: str | None = '0022_checkpoint_pins'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('campaigns', sa.Column('queue_anyway', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.execute("UPDATE campaigns SET queue_anyway = true WHERE policy_id IS NOT NULL")


def downgrade() -> None:
    op.drop_column('campaigns', 'queue_anyway')
