"""The one event path (real Postgres and SQLite): ``events.record`` checks and writes a transition, then
calls the subscribers ``services`` installed, in their fixed order; builds born in a submit or a group
commit go through it too; a process that never installed them fails before writing anything."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, select

from compilesvc.builds.submit import Submitter
from compilesvc.ledger import events
from compilesvc.ledger.build_records import BuildRecord, BuildRecorder, births
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.webhooks import EventSubscription, Webhook, WebhookDelivery
from compilesvc.lifecycle import campaigns
from compilesvc.notify import webhooks
from compilesvc.services import SUBSCRIBERS, Services
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.settings import make_settings
from tests.fixtures.submits import complete_bucket, spec_doc, upload_model
from tests.ledger.test_build_records import published_artifact, record

HOOK = "http://127.0.0.1:9/hook"
WATCHER = "http://127.0.0.1:9/deploy"


@contextmanager
def listening(engine: Engine, name: str, listener: Callable[..., Any]) -> Iterator[None]:
    event.listen(engine, name, listener)
    try:
        yield
    finally:
        event.remove(engine, name, listener)


def deliveries(services: Services) -> list[tuple[str, str]]:
    """(to whom, event) of every delivery, in the order they were written."""
    with services.sessions() as session:
        rows = session.execute(select(WebhookDelivery.webhook_id, WebhookDelivery.event)
                               .order_by(WebhookDelivery.id)).all()
    return [("callback" if row.webhook_id is not None else "subscription", row.event) for row in rows]


def test_the_subscribers_are_installed_in_one_fixed_order(services: Services) -> None:
    assert SUBSCRIBERS == (webhooks.BUILD_CALLBACKS, campaigns.BUILDS, webhooks.SUBSCRIPTIONS)
    assert events.installed() == SUBSCRIBERS  # Services installed them
    assert [s.name for s in events.installed()] == ["build callbacks", "campaigns", "event subscriptions"]


def test_a_failing_build_notifies_its_callbacks_then_the_subscriptions(tmp_path: Path, ledger_url: str) -> None:
    services = Services.from_settings(make_settings(tmp_path, ledger_url, webhook_allow_networks="127.0.0.0/8"))
    try:
        with transaction(services.sessions) as session:
            session.add(EventSubscription(url=WATCHER, event="build.failed"))
        submitter = Submitter(services)
        spec = parse_spec(spec_doc(upload_model(services), callbacks=[HOOK]))
        first = submitter.submit(spec)
        assert deliveries(services) == []  # building: nothing to say yet
        complete_bucket(services, first.buckets[0].key, state="failed", error_class="compile")
        moved = [("callback", "build.failed"), ("subscription", "build.failed")]
        assert deliveries(services) == moved

        # A build born failed (the negative cache answers it) goes the same way: its callbacks are recorded
        # and notified in its creation's transaction, and the subscription hears of it too.
        again = submitter.submit(spec)
        assert (again.outcome, again.state) == ("join", "failed")
        assert deliveries(services) == moved * 2
        with services.sessions() as session:
            assert session.scalars(select(Webhook.url).where(Webhook.build_id == again.build_id)).all() == [HOOK]
    finally:
        services.close()


def test_group_committed_builds_go_through_the_subscribers(services: Services) -> None:
    artifact_id = published_artifact(services)
    plain = record(artifact_id, 1)
    assert not events.wanted(births([plain]))  # a hit wants nothing: its batch stays one autocommit statement
    recorder = BuildRecorder(services.engine)
    statements: list[str] = []
    try:
        with listening(services.engine, "before_cursor_execute", lambda *args: statements.append(args[2])):
            recorder.record(plain)
        if services.engine.dialect.name == "postgresql":  # the hit's design: one statement, no BEGIN/COMMIT
            assert len(statements) == 1 and "INSERT INTO events" in statements[0]
        hooked = BuildRecord(row=dict(record(artifact_id, 2).row), labels={}, detail={"outcome": "hit"},
                             callbacks=(HOOK,))
        assert events.wanted(births([hooked]))
        build_id = recorder.record(hooked)
    finally:
        recorder.close()
    with services.sessions() as session:
        assert session.scalars(select(Webhook.url).where(Webhook.build_id == build_id)).all() == [HOOK]
        notified = session.execute(select(WebhookDelivery.build_id, WebhookDelivery.event)).all()
    assert [tuple(row) for row in notified] == [(build_id, "build.succeeded")]


def test_an_event_written_without_the_subscribers_fails_before_anything_is_written(tmp_path: Path) -> None:
    """A fresh process that writes to the ledger without Services (nor install_subscribers) is told how to
    fix it, and writes nothing: no event row without its webhooks."""
    probe = textwrap.dedent(f"""
        from sqlalchemy import create_engine, func, select
        from sqlalchemy.orm import Session
        from compilesvc.ledger import events
        from compilesvc.ledger.models import Base, Event
        engine = create_engine("sqlite:///{tmp_path}/ledger.db")
        Base.metadata.create_all(engine)
        with Session(engine) as session:
            try:
                events.record(session, "build", 1, None, "building")
            except events.SubscribersNotInstalled as exc:
                print(exc)
            print("events:", session.scalar(select(func.count()).select_from(Event)))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    message, written = result.stdout.strip().splitlines()
    assert "compilesvc.services.install_subscribers()" in message
    assert written == "events: 0"
