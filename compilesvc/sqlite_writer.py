"""One SQLite writer at a time, in the order they asked, across threads and processes.

Every ledger transaction on SQLite takes the database's write lock up front (``BEGIN IMMEDIATE``:
:mod:`compilesvc.db`). When another connection holds it, SQLite's busy handler does not queue the
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
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from typing import Any

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
        self._lock_fd: int | None = None
        self._lock_pid = 0
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
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # releases the GIL while it waits
        self._owner = threading.get_ident()
        _holders.add(self._owner)

    def _release(self) -> None:
        if not self._owner:
            return
        _holders.discard(self._owner)
        self._owner = 0
        # A lock taken before a fork is the parent's to give back: the descriptor is shared with it.
        if self._lock_fd is not None and self._lock_pid == os.getpid():
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
