"""Roll-forward policies in the ledger: several workers of a new release registering at once on Postgres
(each in its own transaction, as hosts do) fire each policy once, and one of them is the release's first
worker; a worker that waits on another's uncommitted registration claims nothing once it commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.dispatch import registry
from compilesvc.ledger.campaigns import PolicyRun, SdkRelease
from compilesvc.ledger.engine import make_engine, make_sessionmaker, transaction
from compilesvc.lifecycle import policies
from compilesvc.services import install_subscribers


@pytest.fixture
def pg_sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    install_subscribers()
    engine = make_engine(pg_url)
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


def caps(sdk: str) -> dict[str, object]:
    return {"targets": ["inf2", "trn1"], "sdk": {"inf2": sdk, "trn1": sdk}}


def register(sessions: sessionmaker[Session], worker_id: str, sdk: str) -> list[policies.Claim]:
    with transaction(sessions) as session:
        registry.register(session, worker_id, "host", caps(sdk), [f"compile.inf2.{sdk}"], 1)
        return policies.claim(session, worker_id, caps(sdk))


def test_workers_registering_at_once_fire_each_policy_once(pg_sessions: sessionmaker[Session]) -> None:
    with transaction(pg_sessions) as session:
        policies.add(session, name="all")
        policies.add(session, name="trn1", target="trn1")
    workers = [f"w{i}" for i in range(6)]
    start = threading.Barrier(len(workers))
    claimed: dict[str, list[policies.Claim]] = {}

    def run(worker_id: str) -> None:
        start.wait()
        claimed[worker_id] = register(pg_sessions, worker_id, "2.25.0")

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(claimed) == workers  # every registration went through
    all_claims = [c for found in claimed.values() for c in found]
    assert sorted((c.target, c.to_sdk) for c in all_claims) == [("inf2", "2.25.0"), ("trn1", "2.25.0")]
    with pg_sessions() as session:
        assert session.scalar(select(func.count()).select_from(PolicyRun)) == 2
        firsts = {r.target: r.first_worker_id for r in session.scalars(select(SdkRelease))}
    assert set(firsts) == {"inf2", "trn1"}
    assert {c.target: w for w, found in claimed.items() for c in found} == firsts  # the first worker claims


def test_a_registration_waiting_on_an_uncommitted_first_one_claims_nothing(
        pg_sessions: sessionmaker[Session]) -> None:
    with transaction(pg_sessions) as session:
        policies.add(session, name="all")
    second: list[list[policies.Claim]] = []
    with transaction(pg_sessions) as session:
        first = policies.claim(session, "w-a", caps("2.26.0"))
        waiter = threading.Thread(target=lambda: second.append(register(pg_sessions, "w-b", "2.26.0")))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # its insert of the release waits for this transaction
    waiter.join(10)
    assert [(c.target, c.to_sdk) for c in first] == [("inf2", "2.26.0")] and second == [[]]
