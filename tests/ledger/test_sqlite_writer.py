"""SQLite writers queue on a file lock (compilesvc.ledger.sqlite_writer): across processes, in order, woken as soon
as the lock is free, and never waiting for themselves."""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from compilesvc.ledger.engine import make_engine
from compilesvc.ledger.sqlite_writer import WriterConnection


def _hold_then_commit(path: str, held: multiprocessing.Event, release: multiprocessing.Event) -> None:
    engine = make_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO t VALUES ('first')"))
        held.set()
        release.wait(30)
    engine.dispose()


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    path = str(tmp_path / "ledger.db")
    engine = make_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (v TEXT)"))
    engine.dispose()
    return path


@contextmanager
def holder_elsewhere(ledger: str) -> Iterator[tuple[int, multiprocessing.synchronize.Event]]:
    """Another process in the middle of a write transaction (it inserted 'first'); it commits once the
    yielded event is set (at the latest when the block ends). Yields its pid and that event."""
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_then_commit, args=(ledger, held, release))
    holder.start()
    try:
        assert held.wait(60)
        yield holder.pid or 0, release
    finally:
        with suppress(ProcessLookupError):
            os.kill(holder.pid or 0, signal.SIGCONT)
        release.set()
        holder.join(30)


def lock_is_free(ledger: str) -> bool:
    """Whether the file lock writers queue on is free (taken and given back at once if so)."""
    probe = os.open(f"{ledger}-writer.lock", os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(probe)
    return True


def test_a_writer_in_another_process_gets_the_lock_as_soon_as_it_is_free(ledger: str) -> None:
    with holder_elsewhere(ledger) as (_pid, release):
        assert not lock_is_free(ledger)  # the holder's transaction holds the file lock that writers queue on
        engine = make_engine(f"sqlite:///{ledger}")
        waited: list[float] = []

        def write() -> None:
            with engine.begin() as conn:
                waited.append(time.monotonic())
                conn.execute(text("INSERT INTO t VALUES ('second')"))

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)
        assert not waited, "the second writer began while the first held the lock"
        released_at = time.monotonic()
        release.set()
        writer.join(30)
        # Woken by the kernel when the holder let go; SQLite's busy handler would be polling every 100 ms by
        # now (its delays add up to 408 ms before they reach 100 each).
        assert waited and waited[0] - released_at < 0.09
        with engine.connect() as conn:
            assert conn.execute(text("SELECT v FROM t ORDER BY rowid")).scalars().all() == ["first", "second"]
        engine.dispose()


def test_a_thread_that_holds_the_lock_does_not_wait_for_itself(ledger: str) -> None:
    """A second write transaction in the same thread, on another connection, gets SQLite's busy timeout (an
    error) rather than waiting on the file lock forever."""
    engine = make_engine(f"sqlite:///{ledger}")
    with engine.begin() as outer:
        outer.execute(text("INSERT INTO t VALUES ('outer')"))
        inner = sqlite3.connect(ledger, timeout=0.2, isolation_level=None, factory=WriterConnection)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                inner.begin_immediate()
        finally:
            inner.close()
    with engine.begin() as conn:  # and the lock was given back
        conn.execute(text("INSERT INTO t VALUES ('after')"))
    engine.dispose()


def test_a_failed_transaction_gives_the_lock_back(ledger: str) -> None:
    engine = make_engine(f"sqlite:///{ledger}")
    with pytest.raises(Exception, match="no such table"), engine.begin() as conn:
        conn.execute(text("INSERT INTO missing VALUES (1)"))
    done = threading.Event()

    def write() -> None:
        with make_engine(f"sqlite:///{ledger}").begin() as conn:
            conn.execute(text("INSERT INTO t VALUES ('next')"))
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(10)
    engine.dispose()


def _turns() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sqlite-writer-turn"]


def test_a_holder_that_hangs_fails_the_writers_behind_it_after_the_busy_timeout(ledger: str) -> None:
    """A process stopped in the middle of its write transaction keeps the lock: the writers behind it get
    SQLite's "database is locked" (as a DBAPIError, which the API answers 503) after the URL's timeout, not
    a wait without end; and when the holder goes on, the lock is free again (no helper kept it)."""
    engine = make_engine(f"sqlite:///{ledger}?timeout=0.5")
    errors: list[BaseException] = []
    waits: list[float] = []

    def write() -> None:
        started = time.monotonic()
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES ('never')"))
        except Exception as exc:  # checked below
            errors.append(exc)
        waits.append(time.monotonic() - started)

    with holder_elsewhere(ledger) as (pid, _release):
        os.kill(pid, signal.SIGSTOP)
        writers = [threading.Thread(target=write) for _ in range(3)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(10)
        assert len(errors) == 3 and all(isinstance(e, OperationalError) for e in errors), errors
        assert all("database is locked" in str(e) for e in errors)
        assert all(0.45 < w < 3 for w in waits), waits
        assert len(_turns()) == 3  # still queued on the lock, each for its own descriptor
    deadline = time.monotonic() + 10
    while _turns() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _turns(), "a helper that got the lock after its caller gave up must let it go and end"
    assert lock_is_free(ledger)  # nobody kept it
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO t VALUES ('after')"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT v FROM t ORDER BY rowid")).scalars().all() == ["first", "after"]
    engine.dispose()


def test_a_writer_that_waited_holds_the_lock_until_it_commits(ledger: str) -> None:
    """A contended wait hands the lock to its caller through the helper's descriptor; the next writer queues
    behind it until it commits."""
    engine = make_engine(f"sqlite:///{ledger}")
    in_second, finish_second = threading.Event(), threading.Event()

    def second() -> None:
        with engine.begin() as conn:
            in_second.set()
            finish_second.wait(30)
            conn.execute(text("INSERT INTO t VALUES ('second')"))

    with holder_elsewhere(ledger) as (_pid, release):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.2)
        release.set()
        assert in_second.wait(30)
        assert not lock_is_free(ledger)
        finish_second.set()
        thread.join(30)
        assert lock_is_free(ledger)  # given back at commit
    engine.dispose()


@pytest.mark.parametrize("timeout", ["soon", "-1"])
def test_a_bad_timeout_in_the_url_is_refused_by_name(tmp_path: Path, timeout: str) -> None:
    from compilesvc.config.settings import Settings

    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        Settings(database_url=f"sqlite:///{tmp_path}/x.db?timeout={timeout}")
