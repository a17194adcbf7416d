"""Streaming one compile attempt's output: to a full log file, to a tail kept for the classifier, and to the
central log (``log_lines``) in batches.

The compiler can print thousands of lines, and a user watching a build wants them within a second. So
lines are buffered and written with one multi-row INSERT per batch (:func:`compilesvc.compiles.logs.append_lines`):
whenever ``batch_lines`` are waiting, and otherwise every ``flush_interval`` seconds. The database is
written only from the flusher thread, so a slow or failing database never blocks the pipe reader (and
therefore never blocks the compiler on a full pipe). If the database is unreachable, lines wait (up to
``max_pending``; beyond that the oldest are dropped and the gap is reported in the log), and the full log
file, archived as a blob at the end of the attempt, still has every line.

What a compile prints is bounded (``max_bytes``, ``COMPILESVC_SANDBOX_MAX_LOG_MB``): a hostile model could
otherwise fill the worker's disk and the ledger through its output alone. Past the bound nothing more is
kept, the tail still follows (the classifier reads it) and :meth:`over_limit` tells the runner to stop
the compile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from sqlalchemy.orm import Session, sessionmaker

from compilesvc.compiles.logs import append_lines
from compilesvc.ledger.engine import transaction
from workers.isolation.sandbox import output_limit_why

log = logging.getLogger(__name__)

#: A pipe read never returns more than this many bytes as one line (a newline-less stream stays bounded).
MAX_READ_LINE_BYTES = 64 * 1024


class LogStream:
    """The lines of one attempt of one bucket compile. Thread-safe; :meth:`close` flushes everything."""

    def __init__(self, sessions: sessionmaker[Session], bucket_compile_id: int, attempt: int, log_path: Path,
                 *, flush_interval: float = 0.5, batch_lines: int = 200, tail_lines: int = 200,
                 max_pending: int = 50_000, max_bytes: int | None = None):
        self._sessions = sessions
        self.bucket_compile_id = bucket_compile_id
        self.attempt = attempt
        self.log_path = log_path
        self.flush_interval = flush_interval
        self.batch_lines = batch_lines
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self._compiler_bytes = 0
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._file: IO[str] = open(log_path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._pending: list[tuple[str, str]] = []
        self._dropped = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._flusher = threading.Thread(target=self._run, name=f"logstream-{bucket_compile_id}", daemon=True)
        self._flusher.start()
        self.lines_written = 0

    # -- producers ----------------------------------------------------------------------------------

    def compiler(self, line: str) -> None:
        """A line of the compiler's (the child's) stdout/stderr."""
        self.tail.append(line)
        self._compiler_bytes += len(line) + 1
        if self.max_bytes is None or self._compiler_bytes <= self.max_bytes:
            self._add("compiler", line)
        elif self._compiler_bytes - len(line) - 1 <= self.max_bytes:  # the first line past the bound
            self.service(f"the compile printed more than {self.max_bytes} bytes (COMPILESVC_SANDBOX_MAX_LOG_MB): "
                         f"the rest of its output is not kept")

    def over_limit(self) -> str | None:
        """Why the compile must stop for what it printed, if it printed too much."""
        if self.max_bytes is not None and self._compiler_bytes > self.max_bytes:
            return output_limit_why(self.max_bytes)
        return None

    def service(self, line: str) -> None:
        """A line from the worker itself (claim, fetch, publish, classification)."""
        self._add("service", line)

    def pump(self, pipe: IO[bytes]) -> None:
        """Read ``pipe`` line by line until EOF (run it in its own thread)."""
        try:
            while chunk := pipe.readline(MAX_READ_LINE_BYTES):
                self.compiler(chunk.decode("utf-8", "replace").rstrip("\r\n"))
        except (OSError, ValueError):  # the pipe was closed under us (the runner gave up waiting)
            pass

    def _add(self, stream: str, line: str) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line if stream == "compiler" else f"[compilesvc] {line}")
            self._file.write("\n")
            self._pending.append((stream, line))
            if len(self._pending) > self.max_pending:
                excess = len(self._pending) - self.max_pending
                del self._pending[:excess]
                self._dropped += excess
            full = len(self._pending) >= self.batch_lines
        if full:
            self._wake.set()

    # -- the flusher --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> bool:
        """Write waiting lines to the central log; False (lines kept) if the database failed."""
        with self._lock:
            batch, self._pending = self._pending, []
            dropped, self._dropped = self._dropped, 0
            if not self._file.closed:
                self._file.flush()
        marker = [("service", f"[{dropped} log lines dropped: the central log was unreachable; the archived "
                               "log has them]")] if dropped else []
        if not batch and not marker:
            return True
        try:
            with transaction(self._sessions) as session:
                for stream, lines in _runs(marker + batch):
                    append_lines(session, self.bucket_compile_id, self.attempt, lines, stream=stream)
        except Exception as exc:  # keep the lines for the next flush; the compile must not fail over logs
            log.warning("central log write failed", extra={"bucket_compile_id": self.bucket_compile_id,
                                                          "error": f"{type(exc).__name__}: {exc}"})
            with self._lock:
                self._pending[:0] = batch
                self._dropped += dropped
            return False
        self.lines_written += len(batch)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the flusher, write what is left (retrying briefly), close the file."""
        self._closing.set()
        self._wake.set()
        self._flusher.join(timeout)
        deadline = time.monotonic() + timeout
        while not self.flush() and time.monotonic() < deadline:
            time.sleep(0.5)
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> LogStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _runs(batch: Iterable[tuple[str, str]]) -> Iterable[tuple[str, list[str]]]:
    """Consecutive lines of one stream, so order across streams survives the per-stream INSERTs."""
    current: str | None = None
    lines: list[str] = []
    for stream, line in batch:
        if stream != current and lines:
            yield current or "compiler", lines
            lines = []
        current = stream
        lines.append(line)
    if lines:
        yield current or "compiler", lines
