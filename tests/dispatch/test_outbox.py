"""compilesvc.dispatch.outbox against a real ledger: rows committed while the broker or the ledger is away are never
lost, whoever wrote them (submit, retry) answers anyway, and the relay loop's pass sends them later."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import select

from compilesvc.builds.control import retry_build
from compilesvc.config.settings import Settings
from compilesvc.dispatch.outbox import OutboxRelay
from compilesvc.dispatch.routing import make_producer
from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.ledger.models import Outbox
from compilesvc.services import Services
from tests.compiles.test_leases import _fail_attempt, bucket_id, make_settings, submit


def unsent(services: Services) -> list[Outbox]:
    with services.sessions() as session:
        return list(session.scalars(select(Outbox).where(Outbox.sent_at.is_(None)).order_by(Outbox.id)))


def test_submit_and_retry_answer_during_a_broker_outage_and_the_relay_loop_sends_later(
        tmp_path: Path, ledger_url: str, caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings(tmp_path, ledger_url)
    down = make_producer(Settings(**{**settings.model_dump(), "broker_url": "redis://127.0.0.1:1/0"}))
    down.conf.broker_connection_timeout = 0.5
    away = Services.from_settings(settings, celery_app=down)
    try:
        result = submit(away)
        rows = unsent(away)
        assert len(rows) == 1 and "127.0.0.1:1" in (rows[0].last_error or "")
        bid = bucket_id(away, result.buckets[0].key)
        assert _fail_attempt(away, bid, "compile", "NCC_EVRF001", "refused", 1).state == "failed"  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="compilesvc.dispatch.outbox"):
            requeued = retry_build(away, result.build_id)
        assert len(requeued) == 1 and [r.id for r in unsent(away)][-1] == requeued[0]
        assert any(r.getMessage() == "outbox send failed" and r.outbox_id == requeued[0]  # type: ignore[attr-defined]
                   for r in caplog.records)
    finally:
        away.close()
    back = Services.from_settings(settings)  # the relay loop's process, with the broker back
    try:
        assert len(unsent(back)) == 2  # the first dispatch (its compile has moved on since) and the retry's
        assert back.relay.relay_all() == 2
        assert unsent(back) == []
    finally:
        back.close()


def test_after_commit_never_raises_when_the_ledger_is_away(caplog: pytest.LogCaptureFixture) -> None:
    sessions = make_sessionmaker(make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none"))
    relay = OutboxRelay(sessions, make_producer(Settings(broker_url="filesystem://")))
    with caplog.at_level(logging.WARNING, logger="compilesvc.dispatch.outbox"):
        assert relay.after_commit([7], build_id=3) == 0
    record = next(r for r in caplog.records if r.getMessage().startswith("post-commit relay failed"))
    assert (record.build_id, record.outbox_ids) == (3, [7])  # type: ignore[attr-defined]
