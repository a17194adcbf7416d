"""error classes bad_request (a flag the compiler rejected) and unknown (a failure with no diagnosis)

Revision ID: 0005_error_classes
Revises: 0004_states
Create Date: 2026-11-30 09:00:00.000000

Widens the error_class CHECKs of bucket_compiles and bucket_failures (a snapshot of compilesvc/states.py at
this revision, like 0004's). The downgrade narrows them again, after mapping the new values onto the
nearest old ones so no row is lost: ``bad_request`` was a compile error (final) and ``unknown`` an
infrastructure failure (retried) before this revision.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005_error_classes'
down_revision: str | None = '0004_states'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "'compile', 'model', 'infra', 'timeout', 'cancelled'"
NEW = "'compile', 'bad_request', 'model', 'infra', 'timeout', 'unknown', 'cancelled'"
TABLES = ('bucket_compiles', 'bucket_failures')
DOWNGRADE_MAP = {'bad_request': 'compile', 'unknown': 'infra'}


def _replace_checks(values: str) -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f'ck_{table}_error_class'), type_='check')
            batch_op.create_check_constraint(op.f(f'ck_{table}_error_class'), f"error_class IN ({values})")


def upgrade() -> None:
    _replace_checks(NEW)


def downgrade() -> None:
    for table in TABLES:
        for new, old in DOWNGRADE_MAP.items():
            op.execute(sa.text(f"UPDATE {table} SET error_class = :old WHERE error_class = :new")
                       .bindparams(old=old, new=new))
    _replace_checks(OLD)
