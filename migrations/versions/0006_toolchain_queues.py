"""Neuron compiles are queued by toolchain: compile.<target>.<release>.<kind>

Revision ID: 0006_toolchain_queues
Revises: 0005_error_classes
Create Date: 2026-11-24 00:30:00.000000

Keys hold the toolchain a release resolves to, so releases shipping the same packages share compiles;
their queue is now named by the oldest such release and the kind of compile
(:func:`compilesvc.dispatch.queue_name`), and the dispatch message carries the queue stored on the
compile. This rewrites the stored queue of every Neuron bucket compile, so that a retry or a re-send of a
compile queued before the upgrade goes where the new workers listen (a message already in an old queue is
found missing by the reconciler and sent again). The downgrade restores ``compile.<target>.<sdk>``.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006_toolchain_queues'
down_revision: str | None = '0005_error_classes'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_compiles = sa.table('bucket_compiles', sa.column('id', sa.BigInteger), sa.column('target', sa.String),
                     sa.column('sdk', sa.String), sa.column('backend', sa.String), sa.column('queue', sa.String),
                     sa.column('material', sa.JSON))


def _neuron_rows() -> list[sa.Row]:
    return list(op.get_bind().execute(
        sa.select(_compiles.c.id, _compiles.c.target, _compiles.c.sdk, _compiles.c.backend, _compiles.c.material)
        .where(_compiles.c.target != 'cpu')))


def upgrade() -> None:
    from compilesvc.dispatch import queue_name
    from compilesvc.neuron_releases import NotShipped, UnknownRelease

    for row in _neuron_rows():
        tp_degree = int(((row.material or {}).get('toolchain') or {}).get('tp_degree') or 1)
        try:
            queue = queue_name(row.target, row.sdk, row.backend, None, tp_degree)
        except (UnknownRelease, NotShipped):
            continue  # a release the table does not know has no new-style queue: it keeps its old one
        op.execute(_compiles.update().where(_compiles.c.id == row.id).values(queue=queue))


def downgrade() -> None:
    for row in _neuron_rows():
        op.execute(_compiles.update().where(_compiles.c.id == row.id)
                   .values(queue=f'compile.{row.target}.{row.sdk}'))
