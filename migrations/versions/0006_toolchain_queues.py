"""Neuron compiles are queued by toolchain: compile.<target>.<release>.<kind>

Revision ID: 0006_toolchain_queues
Revises: 0005_error_classes
Create Date: 2026-11-24 00:30:00.000000

Keys hold the toolchain a release resolves to, so releases shipping the same packages share compiles;
their queue is now named by the oldest such release and the kind of compile
(:func:`compilesvc.dispatch.routing.queue_name`), and the dispatch message carries the queue stored on the
compile. This rewrites the stored queue of every Neuron bucket compile, so that a retry or a re-send of a
compile queued before the upgrade goes where the new workers listen (a message already in an old queue is
found missing by the reconciler and sent again); dispatch messages not yet sent get the queue in their
kwargs. The downgrade restores ``compile.<target>.<sdk>`` (and drops the kwarg).
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


_outbox = sa.table('outbox', sa.column('id', sa.BigInteger), sa.column('bucket_compile_id', sa.BigInteger),
                   sa.column('kwargs', sa.JSON), sa.column('sent_at', sa.DateTime))


def _carry_queues(queues: dict[int, str | None]) -> None:
    """Set (or, with None, drop) the ``queue`` kwarg of the unsent dispatch messages of these compiles."""
    rows = op.get_bind().execute(sa.select(_outbox.c.id, _outbox.c.bucket_compile_id, _outbox.c.kwargs)
                                 .where(_outbox.c.sent_at.is_(None)))
    for row in rows:
        if row.bucket_compile_id not in queues:
            continue
        kwargs = {k: v for k, v in dict(row.kwargs or {}).items() if k != 'queue'}
        if queues[row.bucket_compile_id] is not None:
            kwargs['queue'] = queues[row.bucket_compile_id]
        op.execute(_outbox.update().where(_outbox.c.id == row.id).values(kwargs=kwargs))


def _neuron_rows() -> list[sa.Row]:
    return list(op.get_bind().execute(
        sa.select(_compiles.c.id, _compiles.c.target, _compiles.c.sdk, _compiles.c.backend, _compiles.c.material)
        .where(_compiles.c.target != 'cpu')))


def upgrade() -> None:
    from compilesvc.dispatch.routing import queue_name
    from compilesvc.spec.neuron_kinds import NotShipped
    from compilesvc.spec.neuron_releases import UnknownRelease

    queues: dict[int, str | None] = {}
    for row in _neuron_rows():
        tp_degree = int(((row.material or {}).get('toolchain') or {}).get('tp_degree') or 1)
        try:
            queue = queue_name(row.target, row.sdk, row.backend, None, tp_degree)
        except (UnknownRelease, NotShipped):
            continue  # a release the table does not know has no new-style queue: it keeps its old one
        op.execute(_compiles.update().where(_compiles.c.id == row.id).values(queue=queue))
        queues[row.id] = queue
    _carry_queues(queues)


def downgrade() -> None:
    rows = _neuron_rows()
    for row in rows:
        op.execute(_compiles.update().where(_compiles.c.id == row.id)
                   .values(queue=f'compile.{row.target}.{row.sdk}'))
    _carry_queues({row.id: None for row in rows})
