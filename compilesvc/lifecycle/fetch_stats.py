"""When each artifact was last fetched, and how often: counted in memory per lookup, written in batches.

Retention keeps what fleets still load ("not fetched in M days"), so every lookup by key counts; but the
lookup is the fleet's hot path and must not write. :class:`FetchRecorder` adds a lookup to an in-memory
map (a dict update under a lock) and a thread writes the map every ``interval`` seconds: one UPDATE per
artifact looked up since the last write, however many lookups it had. A process that dies loses at most
one interval's counts, which retention's day-scale windows do not notice.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from datetime import UTC, datetime
from typing import cast

from sqlalchemy import Table, bindparam, case, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 30.0

_art = cast(Table, Artifact.__table__)
_UPDATE = (
    update(_art).where(_art.c.key == bindparam("k"))
    .values(fetch_count=_art.c.fetch_count + bindparam("n"),
            last_fetched_at=case((_art.c.last_fetched_at.is_(None), bindparam("at")),
                                 (_art.c.last_fetched_at < bindparam("at"), bindparam("at")),
                                 else_=_art.c.last_fetched_at))
)


class FetchRecorder:
    """Lookups by artifact key, counted here and written to ``artifacts`` in batches (module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], interval: float = DEFAULT_INTERVAL_SECONDS):
        self.sessions = sessions
        self.interval = interval
        self._pending: dict[str, list[float]] = {}  # key -> [count, last unix time]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def record(self, key: str) -> None:
        now = time.time()
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = [1, now]
            else:
                entry[0] += 1
                entry[1] = now
            if self._thread is None:
                # Started by the first lookup, in the process that serves it (gunicorn forks after import).
                self._thread = threading.Thread(target=self._run, name="fetch-recorder", daemon=True)
                self._thread.start()
                atexit.register(self.close)

    def flush(self) -> int:
        """Write what was counted since the last flush; returns how many artifacts were updated. Counts
        that could not be written (the ledger is down) are kept for the next flush."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return 0
        rows = [{"k": key, "n": int(count), "at": datetime.fromtimestamp(at, UTC)}
                for key, (count, at) in sorted(pending.items())]  # sorted: one lock order across processes
        try:
            with transaction(self.sessions) as session:
                session.connection().execute(_UPDATE, rows)
        except SQLAlchemyError as exc:
            log.warning("could not record artifact fetches; keeping them for the next try",
                        extra={"artifacts": len(rows), "error": str(exc)})
            with self._lock:
                for key, (count, at) in pending.items():
                    entry = self._pending.setdefault(key, [0, at])
                    entry[0] += count
                    entry[1] = max(entry[1], at)
            return 0
        return len(rows)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
