"""The ledger's Postgres connections give up on a server that does not answer (issue 38: a relay hung after an
RDS failover): a connect is bounded by libpq's ``connect_timeout``, and every connection carries TCP
keepalives and ``tcp_user_timeout`` (PostgreSQL docs, libpq "Parameter Key Words")."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from compilesvc.ledger.engine import CONNECT_TIMEOUT_SECONDS, PG_CONNECT_ARGS, make_engine
from tests.fixtures.ledger import PG_ADMIN_URL


def test_a_server_that_accepts_and_never_answers_fails_the_connect_within_its_timeout() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody ever answers the startup packet
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{silent.getsockname()[1]}/compilesvc")
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError, match="timeout"), engine.connect():
            pass
        assert time.monotonic() - started < CONNECT_TIMEOUT_SECONDS + 5
    finally:
        engine.dispose()
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        silent.close()


def test_every_connection_carries_keepalives_and_a_user_timeout() -> None:
    engine = make_engine(PG_ADMIN_URL)
    try:
        with engine.connect() as conn:
            info = conn.connection.dbapi_connection.info  # type: ignore[union-attr]
            params = info.get_parameters()
            for name in ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count",
                         "tcp_user_timeout", "connect_timeout"):
                assert params[name] == str(PG_CONNECT_ARGS[name]), name
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()
