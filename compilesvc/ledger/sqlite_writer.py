"""One SQLite writer at a time, in the order they asked, across threads and processes.

Every ledger transaction on SQLite takes the database's write lock up front (``BEGIN IMMEDIATE``:
:mod:`compilesvc.ledger.engine`). When another connection holds it, SQLite's busy handler does not queue the
caller: it sleeps and polls, 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, then 100 ms at a time
(``sqliteDefaultBusyCallback`` in SQLite's ``main.c``). Two API processes recording cache-hit submits take
turns at the lock hundreds of times a second, so a loser routinely slept tens of milliseconds while the
lock sat free, and now and then for seconds: the hit's p99 and the load generator's timeouts.

:class:`WriterConnection` queues writers on an exclusive ``flock`` of a file beside the database before
``BEGIN IMMEDIATE``, and lets go once the transaction has committed or rolled back: the kernel wakes the
next waiter as soon as the lock is free. SQLite's own lock and busy timeout stay underneath, for
connections that do not take part (the ``sqlite3`` shell, another program) and for a thread that already
holds the file lock through another connection (it would wait for itself: it gets SQLite's timeout and an
error instead of a hang, as before).

The wait for the file lock is bounded by the connection's busy timeout, as SQLite's own wait is: a holder
that hangs (a process stopped mid-transaction, a connection left idle in one) must fail the writers behind it
with SQLite's "database is locked" (an error the API answers 503, retryable), not block them forever.
``flock`` itself has no timeout, so a contended wait runs in a helper thread on a descriptor of its own,
which the caller stops waiting for after the timeout; a helper that gets the lock after its caller gave up
lets go of it at once.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from typing import Any

#: ``sqlite3.connect``'s default busy timeout, in seconds.
_DEFAULT_TIMEOUT = 5.0

#: Threads holding the file lock, through one of their connections (a release may come from another thread:
#: a connection the garbage collector hands back to the pool).
_holders: set[int] = set()


class WriterConnection(sqlite3.Connection):
    """A ``sqlite3`` connection whose write transactions queue on a file lock (see the module docstring).

    Pass it as ``sqlite3.connect(..., factory=WriterConnection)`` and open transactions with
    :meth:`begin_immediate`; ``commit`` and ``rollback`` release the lock."""

    def __init__(self, database: Any, *args: Any, **kwargs: Any):
        super().__init__(database, *args, **kwargs)
        path = os.fsdecode(database)
        in_memory = path == ":memory:" or path.startswith("file::memory:") or "mode=memory" in path or not path
        self._lock_path = None if in_memory else f"{path}-writer.lock"
        self._timeout = float(kwargs.get("timeout", args[0] if args else _DEFAULT_TIMEOUT))
        self._lock_fd: int | None = None
        self._lock_pid = 0
        self._held_fd: int | None = None  # the descriptor the file lock is held through
        self._owner = 0  # the thread holding the file lock through this connection; 0: not held

    def begin_immediate(self) -> None:
        """``BEGIN IMMEDIATE``, once this connection's turn has come."""
        self._acquire()
        try:
            self.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._release()
            raise

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._release()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._release()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()
            if self._lock_fd is not None and self._lock_pid == os.getpid():
                os.close(self._lock_fd)
            self._lock_fd = None

    def _acquire(self) -> None:
        if self._lock_path is None or self._owner or threading.get_ident() in _holders:
            return
        if self._lock_fd is None or self._lock_pid != os.getpid():
            # A descriptor inherited through fork shares its lock with the parent's: open our own.
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._lock_pid = os.getpid()
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._held_fd = self._lock_fd
        except BlockingIOError:
            self._held_fd = _wait_for_turn(self._lock_path, self._timeout)
        self._owner = threading.get_ident()
        _holders.add(self._owner)

    def _release(self) -> None:
        if not self._owner:
            return
        _holders.discard(self._owner)
        self._owner = 0
        held, self._held_fd = self._held_fd, None
        # A lock taken before a fork is the parent's to give back: the descriptor is shared with it.
        if held is None or self._lock_pid != os.getpid():
            return
        fcntl.flock(held, fcntl.LOCK_UN)
        if held != self._lock_fd:
            os.close(held)


class _Turn:
    """One contended wait for the file lock, taken by a helper thread on a descriptor of its own (so that
    the lock it may get after its caller gave up is that descriptor's alone, and closing it lets go)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.got = threading.Event()
        self._decided = threading.Lock()
        self._abandoned = False

    def wait_in_helper(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # releases the GIL while it waits; woken in order
        except OSError:  # ENOLCK and the like: the caller times out with "database is locked"
            os.close(self.fd)
            return
        with self._decided:
            if not self._abandoned:
                self.got.set()
                return
        os.close(self.fd)  # the caller gave up: let go at once

    def abandon(self) -> bool:
        """Give up the wait; False if the helper already got the lock (it is then the caller's)."""
        with self._decided:
            if self.got.is_set():
                return False
            self._abandoned = True
            return True


def _wait_for_turn(path: str, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for the file lock; return the descriptor it is held through, or raise
    SQLite's own error for a lock that stayed busy."""
    turn = _Turn(path)
    threading.Thread(target=turn.wait_in_helper, name="sqlite-writer-turn", daemon=True).start()
    if turn.got.wait(timeout) or not turn.abandon():
        return turn.fd
    raise sqlite3.OperationalError("database is locked")
