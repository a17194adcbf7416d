"""Recording builds: the rows one submission writes, alone or group-committed with concurrent ones.

Every submit records a build (its row, its labels and its creation event), cache hits included, and for
a hit that write is most of the price: a transaction of its own is a BEGIN, three inserts and a COMMIT.
:class:`BuildRecorder` lets concurrent hits share one: callers line up, and the caller at the head writes
everything in line in a single transaction (on SQLite, an ``executemany`` and the new ids read back under
the write lock: :func:`insert_builds`) while the others wait. A caller is answered only once the commit
holding its row is done, so nothing is acknowledged before it is durable. Alone, a record is written at
once; under load, batches form by themselves, with no timer.

On Postgres a batch is one statement (:data:`_PG_WRITE`): the rows travel as one JSON document, and data-
modifying CTEs insert the builds, their labels and their events together, in autocommit. One round trip
instead of five (BEGIN, three inserts, COMMIT), and one statement's worth of client-side work: a profile of
cache-hit submits on Postgres spent more CPU in the driver and SQLAlchemy for these five than in the rest
of the request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, cast

import orjson
from sqlalchemy import Connection, Engine, Table, func, insert, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from compilesvc.ledger import events
from compilesvc.ledger.events import Transition
from compilesvc.ledger.models import Build, BuildLabel

log = logging.getLogger(__name__)

#: A leaders' connection unused for this long goes back to the pool: proxies and servers end idle ones.
_KEEP_IDLE_SECONDS = 60.0

# Built once, rows passed as parameters: a statement with literal values is compiled and cache-keyed value
# by value on every call, which costs more than the insert itself.
_BUILDS = cast(Table, Build.__table__)
_INSERT_BUILDS = insert(_BUILDS).returning(_BUILDS.c.id, sort_by_parameter_order=True)
_INSERT_LABELS = insert(cast(Table, BuildLabel.__table__))

#: The builds' columns a record may set (all but the id).
_BUILD_COLUMNS = [column.name for column in _BUILDS.columns if column.name != "id"]
#: Python-side column defaults (created_at), which SQLAlchemy applies itself and a JSON document must carry.
_BUILD_DEFAULTS = {column.name: column.default for column in _BUILDS.columns
                   if column.default is not None and column.name != "id"}
#: A batch on Postgres: the rows are ``:rows``, a JSON array of objects with the builds' columns plus
#: ``_labels`` and ``_detail``. Ids are assigned in the order the SELECT feeds the INSERT (ORDER BY n): the
#: same guarantee SQLAlchemy's ``sort_by_parameter_order`` relies on for Postgres, so the n-th smallest id
#: returned is the n-th record's.
_PG_WRITE = text(f"""
WITH src AS (
    SELECT doc, n FROM jsonb_array_elements(CAST(:rows AS jsonb)) WITH ORDINALITY AS t(doc, n)
), b AS (
    INSERT INTO builds ({", ".join(_BUILD_COLUMNS)})
    SELECT {", ".join(f"r.{name}" for name in _BUILD_COLUMNS)}
    FROM src, jsonb_populate_record(NULL::builds, src.doc) AS r
    ORDER BY src.n
    RETURNING id, state
), numbered AS (
    SELECT id, state, row_number() OVER (ORDER BY id) AS n FROM b
), labels AS (
    INSERT INTO build_labels (build_id, name, value)
    SELECT numbered.id, kv.key, kv.value
    FROM numbered JOIN src USING (n), jsonb_each_text(src.doc -> '_labels') AS kv
), created AS (
    INSERT INTO events (at, entity, entity_id, from_state, to_state, detail)
    SELECT now(), 'build', numbered.id, NULL, numbered.state, src.doc -> '_detail'
    FROM numbered JOIN src USING (n)
)
SELECT id FROM numbered ORDER BY n
""")


@dataclass
class BuildRecord:
    """One submission's build: the ``builds`` row (without id), its labels, its creation event's detail."""

    row: dict[str, Any]
    labels: dict[str, str]
    detail: dict[str, Any]
    #: Its callback URLs (the webhooks subscriber records them); a group-committed record has none.
    callbacks: tuple[str, ...] = ()
    done: Future[int] = field(default_factory=Future)
    #: Set when a leader has written it, or when it is at the head of the line and leads (:class:`BuildRecorder`).
    turn: threading.Event = field(default_factory=threading.Event)


def insert_builds(conn: Connection, records: list[BuildRecord]) -> list[int]:
    """Insert the records' build rows; their ids, in order."""
    if conn.dialect.name == "sqlite" and len(records) > 1:
        return _insert_builds_sqlite(conn, records)
    return list(conn.execute(_INSERT_BUILDS, [r.row for r in records]).scalars())


def _insert_builds_sqlite(conn: Connection, records: list[BuildRecord]) -> list[int]:
    """Several rows on SQLite: SQLAlchemy sends ``INSERT … RETURNING`` once per row there (SQLite does not
    promise RETURNING's order), so insert them in one ``executemany`` and read the ids back instead. The
    transaction holds SQLite's write lock from its start (``BEGIN IMMEDIATE``: :mod:`compilesvc.ledger.engine`), so the
    ids above the largest one before are this batch's, given in insertion order (a rowid is the largest + 1).
    All rows must set the same columns, as they do (``SubmitContext.build_record``)."""
    before = conn.execute(select(func.max(_BUILDS.c.id))).scalar() or 0
    conn.execute(insert(_BUILDS), [r.row for r in records])
    ids = list(conn.execute(select(_BUILDS.c.id).where(_BUILDS.c.id > before).order_by(_BUILDS.c.id)).scalars())
    if len(ids) != len(records):
        raise RuntimeError(f"inserted {len(records)} builds, found {len(ids)} new ids: was the write lock held?")
    return ids


def births(records: list[BuildRecord], build_ids: list[int] | None = None) -> list[Transition]:
    """The records' creation events (with ids 0 before the builds are inserted: checks do not read them)."""
    ids = build_ids if build_ids is not None else [0] * len(records)
    return [Transition("build", build_id, None, record.row["state"], record.detail, record.callbacks)
            for record, build_id in zip(records, ids, strict=True)]


def insert_build_details(bind: Session | Connection, records: list[BuildRecord], build_ids: list[int]) -> None:
    """Insert the labels and creation events of builds already inserted under ``build_ids`` (the events through
    :func:`compilesvc.ledger.events.record_all`, which tells their subscribers)."""
    labels = [{"build_id": build_id, "name": name, "value": value}
              for record, build_id in zip(records, build_ids, strict=True) for name, value in record.labels.items()]
    if labels:
        bind.execute(_INSERT_LABELS, labels)
    events.record_all(bind, births(records, build_ids))


def write_records(conn: Connection, records: list[BuildRecord]) -> list[int]:
    """Insert the records' builds, labels and creation events in ``conn``'s transaction and tell the events'
    subscribers; the builds' ids, in order. On Postgres in one statement (:data:`_PG_WRITE`)."""
    if conn.dialect.name == "postgresql":
        return _write_postgres(conn, records)
    build_ids = insert_builds(conn, records)
    insert_build_details(conn, records, build_ids)
    return build_ids


class BuildRecorder:
    """Group commit for build records (see the module docstring). Thread-safe; one per process.

    Leader and followers, as LevelDB's write queue: callers line up; the one at the head writes everything
    queued behind it in one transaction while the others wait, then hands the head to the next caller that
    was not in its batch. No writer thread: the caller that would have waited for one does the write
    itself, which saves a thread switch per batch and the interpreter's lock passing between them (under
    wrk, a writer thread spent 1.1-1.2 ms of CPU per batch of 2.5 records, where the same write alone in a
    loop takes 0.55-0.84 ms)."""

    def __init__(self, engine: Engine, max_batch: int = 256):
        self._engine = engine
        self._max_batch = max_batch
        self._line: deque[BuildRecord] = deque()
        self._lock = threading.Lock()
        # The leaders' connection, kept between batches: only the caller at the head of the line uses it, and
        # checking one out of the pool (and setting autocommit on it) for each batch took about a quarter of
        # the write's samples in a py-spy profile. Dropped after any failure; a fresh one opens for the next.
        self._conn: Connection | None = None
        self._conn_pid = 0
        self._used = 0.0

    def record(self, record: BuildRecord) -> int:
        """Write ``record`` (with whatever else is queued) and return its build id once committed."""
        with self._lock:
            self._line.append(record)
            leads = len(self._line) == 1
        if not leads:
            record.turn.wait()  # set once written by a leader, or once at the head of the line
            if record.done.done():
                return record.done.result()
        with self._lock:
            batch = list(islice(self._line, self._max_batch))
        try:
            self._write(batch)
        except BaseException as exc:  # the line outlives any one batch: its callers get an error
            failure = RuntimeError(f"recording the build failed: {type(exc).__name__}: {exc}")
            for queued in batch:
                if not queued.done.done():
                    queued.done.set_exception(failure)
        finally:
            with self._lock:
                for _ in batch:
                    self._line.popleft()
                head = self._line[0] if self._line else None
            for queued in batch[1:]:
                queued.turn.set()
            if head is not None:
                head.turn.set()
        return record.done.result()

    @property
    def waiting(self) -> int:
        """How many records are in line (the head's included)."""
        with self._lock:
            return len(self._line)

    def close(self) -> None:
        """Give the leaders' connection back (before the engine is disposed of)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None and self._conn_pid == os.getpid():
            conn.close()

    def _connection(self) -> Connection:
        now = time.monotonic()
        if self._conn is not None and now - self._used > _KEEP_IDLE_SECONDS:
            self.close()  # the pool's recycling, which a connection kept out of it does not get
        if self._conn is None or self._conn_pid != os.getpid():  # a copy inherited through fork is the parent's
            conn = self._engine.connect()
            if self._engine.dialect.name == "postgresql":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            self._conn, self._conn_pid = conn, os.getpid()
        self._used = now
        return self._conn

    def _write(self, batch: list[BuildRecord]) -> None:
        try:
            if events.wanted(births(batch)):  # a subscriber writes too: in one transaction with the builds
                with self._engine.begin() as conn:
                    build_ids = write_records(conn, batch)
            else:
                build_ids = self._write_on_kept_connection(batch)
        except Exception as exc:
            if len(batch) > 1 and not _unavailable(exc):
                # One bad record must not fail its neighbours: write each alone, so only it gets the error.
                log.warning("group commit failed; writing its records one by one", extra={"records": len(batch)})
                for record in batch:
                    self._write([record])
                return
            for record in batch:
                record.done.set_exception(exc)
            return
        for record, build_id in zip(batch, build_ids, strict=True):
            record.done.set_result(build_id)

    def _write_on_kept_connection(self, batch: list[BuildRecord]) -> list[int]:
        """The batch on the leaders' connection, on Postgres in autocommit: nothing but the builds is written."""
        conn = self._connection()
        try:
            if self._engine.dialect.name == "postgresql":
                build_ids = write_records(conn, batch)
                conn.commit()  # autocommit: only ends the transaction SQLAlchemy began for the statement
                return build_ids
            with conn.begin():
                return write_records(conn, batch)
        except BaseException:
            self.close()
            raise


def _write_postgres(conn: Connection, batch: list[BuildRecord]) -> list[int]:
    """The batch in one statement (:data:`_PG_WRITE`, which writes the events too) on ``conn``, then the
    events' subscribers; the builds' ids in order."""
    events.check(births(batch))
    rows = orjson.dumps([{**_defaults(record.row), **record.row, "_labels": record.labels, "_detail": record.detail}
                         for record in batch],
                        # As json.dumps would: a key that is not a string as one; datetimes in RFC 3339 with
                        # their offset, which Postgres reads as the same instant.
                        option=orjson.OPT_NON_STR_KEYS).decode()
    build_ids = list(conn.execute(_PG_WRITE, {"rows": rows}).scalars())
    events.notify(conn, births(batch, build_ids))
    return build_ids


def _defaults(row: dict[str, Any]) -> dict[str, Any]:
    return {name: default.arg(None) if default.is_callable else default.arg  # type: ignore[attr-defined]
            for name, default in _BUILD_DEFAULTS.items() if name not in row}


def _unavailable(exc: Exception) -> bool:
    """The database is away: every record would fail alike, so retrying them one by one only adds load."""
    return isinstance(exc, OperationalError)
