"""UI sessions end on the server: a copy of the cookie taken before logout opens nothing afterwards (at once
in the process that logged out, within the token cache time in another), and revoking a token ends every
session made with it. Real apps on the real ledgers (Postgres and SQLite)."""

from __future__ import annotations

import time

from flask.testing import FlaskClient
from sqlalchemy import select

from compilesvc.access.tokens import token_hash
from compilesvc.access.ui_sessions import session_hash
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ApiToken, utcnow
from compilesvc.ledger.ui_sessions import UiSession
from tests.fixtures.tokens import make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env
from tests.web.test_auth import csrf_of, login

COOKIE = "compilesvc_session"
SECRET_KEY = "sessions-test-secret-key-0123456789abcdef"


def copy_of(browser: FlaskClient, into: FlaskClient) -> FlaskClient:
    """``into`` with the cookie ``browser`` has now, as an attacker who copied it would hold it."""
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None
    into.set_cookie(COOKIE, cookie.value)
    return into


def stolen_secret(client: FlaskClient) -> str:
    """The session secret inside a (signed, not encrypted) cookie, as its holder can read it."""
    with client.session_transaction() as session:
        return str(session["sid"])


def opens_history(client: FlaskClient) -> bool:
    answer = client.get("/")
    assert answer.status_code in (200, 303), answer.status_code
    return answer.status_code == 200


def token_id_of(env: Env, secret: str) -> int:
    with env.services.sessions() as db:
        found = db.scalar(select(ApiToken.id).where(ApiToken.token_hash == token_hash(secret)))
    assert found is not None
    return int(found)


def test_a_cookie_copied_before_logout_is_dead_after_it(env: Env) -> None:
    reader = make_token(env.services.sessions, "read", owner="eve")
    browser = env.app.test_client()
    assert login(browser, reader).status_code == 303
    thief = copy_of(browser, env.app.test_client())
    secret = stolen_secret(thief)
    assert opens_history(thief)  # the copy works while the session lives (and is now cached)

    assert browser.post("/logout", data={"csrf_token": csrf_of(browser, "/")}).status_code == 303
    assert not opens_history(thief)
    assert not opens_history(browser)
    with env.services.sessions() as db:
        rows = list(db.scalars(select(UiSession)))
    assert len(rows) == 1 and rows[0].ended_at is not None
    assert rows[0].id_hash == session_hash(secret)  # the ledger holds its hash, not the secret

    # Logging in again makes a new session; the old copy stays dead.
    assert login(browser, reader).status_code == 303
    replay = env.app.test_client()
    with replay.session_transaction() as session:
        session["sid"] = secret  # the copied cookie, signed as it was
    assert opens_history(browser) and not opens_history(replay)


def test_revoking_a_token_ends_all_its_sessions_and_no_other(env: Env) -> None:
    submitter = make_token(env.services.sessions, "submit", owner="ann")
    other = make_token(env.services.sessions, "read", owner="bob")
    laptop, desktop, bobs = (env.app.test_client() for _ in range(3))
    for browser, token in ((laptop, submitter), (desktop, submitter), (bobs, other)):
        assert login(browser, token).status_code == 303
        assert opens_history(browser)
    stolen = copy_of(laptop, env.app.test_client())

    assert env.client.post(f"/v1/tokens/{token_id_of(env, submitter)}/revoke").status_code == 200
    assert not opens_history(laptop) and not opens_history(desktop) and not opens_history(stolen)
    assert opens_history(bobs)
    with env.services.sessions() as db:
        ended = {row.token_id: row.ended_at is not None for row in db.scalars(select(UiSession))}
    assert ended == {token_id_of(env, submitter): True, token_id_of(env, other): False}


def test_another_process_trusts_a_checked_session_for_the_cache_time_only(make_env: EnvFactory,
                                                                          sqlite_url: str) -> None:
    # Two apps on one ledger are two API processes: each has its own cache of checked sessions.
    here = make_env(sqlite_url, token_cache_seconds=1, secret_key=SECRET_KEY)
    there = make_env(sqlite_url, token_cache_seconds=1, secret_key=SECRET_KEY)
    reader = make_token(here.services.sessions, "read", owner="eve")
    browser = here.app.test_client()
    assert login(browser, reader).status_code == 303
    elsewhere = copy_of(browser, there.app.test_client())
    assert opens_history(elsewhere)

    assert browser.post("/logout", data={"csrf_token": csrf_of(browser, "/")}).status_code == 303
    time.sleep(1.1)  # the other process's cached check runs out
    assert not opens_history(elsewhere)


def test_a_session_lasts_no_longer_than_its_row(make_env: EnvFactory, ledger_url: str) -> None:
    env = make_env(ledger_url, token_cache_seconds=0)
    reader = make_token(env.services.sessions, "read", owner="eve")
    browser = env.app.test_client()
    assert login(browser, reader).status_code == 303 and opens_history(browser)
    with transaction(env.services.sessions) as db:
        for row in db.scalars(select(UiSession)):
            row.expires_at = utcnow()
    assert not opens_history(browser)


def test_a_cookie_from_before_server_side_sessions_logs_in_again(sqlite_env: Env) -> None:
    browser = sqlite_env.app.test_client()
    with browser.session_transaction() as session:
        session["tid"] = token_id_of(sqlite_env, sqlite_env.token)  # what the cookie named before
    answer = browser.get("/")
    assert answer.status_code == 303 and answer.headers["Location"].startswith("/login")
