"""Fixtures for the web tests: the real app over real ledgers (Postgres and SQLite), stores (local, S3)
and the kombu filesystem broker in the test's directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from compilesvc.services import Services
from tests.fixtures.s3server import S3Server
from tests.fixtures.tokens import make_token
from tests.web.support import Env, make_settings
from web.server.app import create_app

EnvFactory = Callable[..., Env]


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[EnvFactory]:
    """Build Envs with settings overrides; closes their services afterwards."""
    made: list[Services] = []
    apps: list[Any] = []

    def factory(database_url: str, *, config: dict[str, Any] | None = None, with_token: bool = True,
                **overrides: Any) -> Env:
        services = Services.from_settings(make_settings(tmp_path / f"env{len(made)}", database_url, **overrides))
        made.append(services)
        app = create_app(services=services, config=config)
        apps.append(app)
        app.testing = True
        # The client is an admin unless a test says otherwise (tests/web/test_auth.py checks every scope).
        token = make_token(services.sessions, "admin", owner="web-tests") if with_token else ""
        client = app.test_client()
        if token:
            client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {token}"
        return Env(app=app, client=client, services=services, token=token)

    yield factory
    for app in apps:
        app.extensions["compilesvc"].fetches.close()  # its last counts, while the ledger is still there
    for services in made:
        services.close()


@pytest.fixture
def env(make_env: EnvFactory, ledger_url: str) -> Env:
    """The app on each ledger (Postgres, SQLite) with a local store."""
    return make_env(ledger_url)


@pytest.fixture
def sqlite_env(make_env: EnvFactory, sqlite_url: str) -> Env:
    return make_env(sqlite_url)


@pytest.fixture
def s3_env(make_env: EnvFactory, sqlite_url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Env:
    """The app with its artifact store in a bucket of the real S3 server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.new_bucket("web")
    return make_env(sqlite_url, store_url=f"s3://{bucket}/artifacts", s3_endpoint_url=s3_server.endpoint_url)
