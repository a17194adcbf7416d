"""The gunicorn worker class of ``compilesvc serve``: gthread, hardened against slow and malformed clients.

gunicorn's threaded worker hands a connection to a pool thread as soon as its first byte arrives, and that
thread then blocks, with no timeout, until the whole request head is in: a client sending one header line
every few seconds holds a thread for as long as it likes, and a few dozen such clients hold all of them.
This worker changes four things and nothing else:

- **Request heads are read on the worker's event loop**, not in a thread: a connection (new, or kept alive
  between requests) is handed to the thread pool only once its head is complete (``\\r\\n\\r\\n`` seen) or
  larger than :data:`MAX_BUFFERED_HEAD`. A head not complete within ``header_timeout`` seconds of the
  connection's first readiness is answered 408 and closed. Slow heads cost a socket and a buffer, never a
  thread.
- **Every socket read and write in a thread has a timeout** (``io_timeout``): a request body that stops
  arriving, or a client that stops reading its response, frees the thread after that long. A body read
  that times out raises :class:`ClientTimeout`, which the app answers 408 like any HTTP error.
- **A connection that closes lingers off the event loop.** gunicorn 27 closes a connection whose response
  said ``Connection: close`` "gracefully" (RFC 9112 section 9.6: send FIN, then read until the client
  closes, for up to 2 s) in the event loop's own thread, blocking: every other connection of the worker
  waited for it. A client that keeps its socket open after such a response (urllib until its response is
  collected, or anyone on purpose) stalled the whole worker for 2 s (``bench.fleet_fetch``'s lookup printed a
  p99 of 1.0-1.8 s and wrk timeouts). Here the FIN is sent at once and the draining is one more event on the
  loop, given the same 2 s.
- **gunicorn's own error answers are RFC 9457 problem+json**, not its HTML page: a bad request line (400),
  an over-long one (414), too many or too large header fields (431), ... are refused here, before Flask
  sees a request. gunicorn still decides the status and logs the request; only the body changes.

What this cannot do without a proxy in front (docs/deploy.md, "Slow clients"): a body trickling in faster
than one read per ``io_timeout`` holds its thread for as long as it trickles, and connections are limited
only per worker (``worker_connections``), not per client address.
"""

from __future__ import annotations

import contextlib
import errno
import html
import json
import re
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

from gunicorn import glogging, util
from gunicorn.http.unreader import SocketUnreader
from gunicorn.workers.gthread import TConn, ThreadWorker
from werkzeug.exceptions import RequestTimeout

PROBLEM_JSON = "application/problem+json"  # as web.contract.problems; not imported, so the worker loads no Flask app

#: A head longer than this is handed to a thread unfinished (gunicorn's limits then refuse it or read the
#: rest under ``io_timeout``). It bounds the memory a connection can take while its head is being read.
MAX_BUFFERED_HEAD = 64 * 1024

_HEAD_END = b"\r\n\r\n"

#: A closing connection is read (and what it sends dropped) for this long at most, and this much at most,
#: waiting for the client's own close: gunicorn's ``util.close_graceful`` limits.
LINGER_SECONDS = 2.0
LINGER_MAX_DRAIN = 64 * 1024

#: The log line each worker writes once it serves requests.
SERVING = "Worker serving"


@dataclass(frozen=True)
class ClientLimits:
    header_timeout: float = 10.0  # seconds for a whole request head
    io_timeout: float = 60.0  # seconds any one socket read or write may wait in a thread


class ClientTimeout(RequestTimeout, TimeoutError):
    """The client sent nothing (or read nothing) for ``io_timeout`` seconds while its request was served.

    An HTTP 408 for the app's error handlers, and a ``TimeoutError`` for gunicorn's body drain, which gives
    up on the connection quietly when it sees one.
    """

    description = "the client sent no data for too long; the request was abandoned"


class TimedUnreader(SocketUnreader):  # type: ignore[misc]
    """gunicorn's socket reader, with a bounded wait for each read."""

    def __init__(self, sock: socket.socket, timeout: float):
        super().__init__(sock)
        self.timeout = timeout

    def chunk(self, size_hint: int | None = None) -> bytes:
        if self.sock.gettimeout() is None:  # the worker thread set it blocking: bound it again
            self.sock.settimeout(self.timeout)
        try:
            data: bytes = super().chunk(size_hint)
        except ClientTimeout:
            raise
        except TimeoutError:
            raise ClientTimeout() from None
        return data


def problem_bytes(status: int, reason: str, detail: str) -> bytes:
    """A complete HTTP/1.1 response (connection closing) whose body is a problem document."""
    body = json.dumps({"type": "about:blank", "title": reason, "status": status, "detail": detail},
                      ensure_ascii=False).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: {PROBLEM_JSON}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class _Captured:
    """Stands in for the client socket while gunicorn writes its HTML error, to learn status and message."""

    def __init__(self) -> None:
        self.data = b""

    def gettimeout(self) -> float:
        return 0.0

    def setblocking(self, _flag: bool) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.data += data

    send = sendall


_STATUS_RE = re.compile(rb"^HTTP/1\.[01] (\d{3}) ([^\r\n]*)\r\n")
_MESSAGE_RE = re.compile(rb"</h1>\s*(.*?)\s*</body>", re.DOTALL)


def _problem_from_html(raw: bytes) -> bytes:
    status_match = _STATUS_RE.match(raw)
    if status_match is None:
        return problem_bytes(400, "Bad Request", "the request could not be parsed")
    status, reason = int(status_match.group(1)), status_match.group(2).decode("latin-1")
    message_match = _MESSAGE_RE.search(raw)
    detail = html.unescape(message_match.group(1).decode("latin-1")) if message_match else ""
    return problem_bytes(status, reason, detail or reason)


class ProblemThreadWorker(ThreadWorker):  # type: ignore[misc]
    """gthread with request heads read off-thread, bounded socket waits and problem+json errors."""

    limits = ClientLimits()  # set by ``compilesvc serve`` before gunicorn forks its workers

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Connections whose head is being read, oldest deadline first (one timeout for all keeps it sorted).
        self.heads: deque[TConn] = deque()
        # Connections closing (FIN sent), waiting for the client's close; oldest deadline first, as heads.
        self.lingering: deque[TConn] = deque()
        # TLS and HTTP/2 negotiate before the head: those connections keep gunicorn's own path.
        self.off_thread_heads = not self.cfg.is_ssl and getattr(self.cfg, "http2_cleartext", None) in (None, "off")

    def run(self) -> None:
        # Logged once the app is loaded: with --reuse-port a worker's own socket takes connections from the
        # moment it is forked, and they wait until here (tests and benches wait for every worker's line).
        self.log.info("%s (pid: %s)", SERVING, self.pid)
        super().run()

    # -- request heads on the event loop ---------------------------------------------------------------

    def accept(self, listener: socket.socket) -> None:
        if not self.off_thread_heads:
            super().accept(listener)
            return
        try:
            client_sock, client_addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._read_head(TConn(self.cfg, client_sock, client_addr, listener.getsockname()))

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        if not self.off_thread_heads:
            super().on_client_socket_readable(conn, client)
            return
        # A kept-alive connection's next request: its head is read here too, not in a thread.
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._read_head(conn)

    def _read_head(self, conn: TConn) -> None:
        conn.sock.setblocking(False)
        conn.head = bytearray()
        conn.head_deadline = time.monotonic() + self.limits.header_timeout
        self.heads.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_readable, conn))

    def _on_head_readable(self, conn: TConn, _fileobj: Any) -> None:
        try:
            data = conn.sock.recv(MAX_BUFFERED_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop_head(conn)
            return
        seen = len(conn.head)
        conn.head += data
        if conn.head.find(_HEAD_END, max(0, seen - 3)) >= 0 or len(conn.head) >= MAX_BUFFERED_HEAD:
            self._hand_over(conn)

    def _forget_head(self, conn: TConn) -> None:
        self.heads.remove(conn)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)

    def _drop_head(self, conn: TConn, answer: bytes = b"") -> None:
        self._forget_head(conn)
        self.nr_conns -= 1
        if answer:
            with contextlib.suppress(OSError):  # non-blocking, best effort: the client may not be reading
                conn.sock.send(answer)
        conn.close()

    def _hand_over(self, conn: TConn) -> None:
        self._forget_head(conn)
        conn.sock.setblocking(True)
        conn.data_ready = True  # gthread's own wait for a first byte is over
        if conn.parser is None:
            conn.init()
            conn.parser.unreader = TimedUnreader(conn.sock, self.limits.io_timeout)  # type: ignore[attr-defined]
        parser: Any = conn.parser
        parser.unreader.unread(bytes(conn.head))
        del conn.head
        self.enqueue_req(conn)

    # -- closing without blocking the event loop -----------------------------------------------------------

    def finish_request(self, conn: TConn, fs: Any) -> None:
        closing = self.off_thread_heads and not fs.cancelled() and fs.exception() is None and not fs.result()
        if not closing:
            super().finish_request(conn, fs)
            return
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # the FIN goes now; what the client still sends is drained
        except OSError:
            self.nr_conns -= 1
            conn.close()
            return
        conn.sock.setblocking(False)
        conn.linger_deadline = time.monotonic() + LINGER_SECONDS
        conn.drained = 0
        self.lingering.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_linger_readable, conn))

    def _on_linger_readable(self, conn: TConn, _fileobj: Any) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        conn.drained += len(data)
        if not data or conn.drained >= LINGER_MAX_DRAIN:
            self._end_linger(conn)

    def _end_linger(self, conn: TConn) -> None:
        self.lingering.remove(conn)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        while self.lingering and (self.lingering[0].linger_deadline <= now or not self.alive):
            self._end_linger(self.lingering[0])
        while self.heads and (self.heads[0].head_deadline <= now or not self.alive):
            conn = self.heads[0]
            if not self.alive or not conn.head:
                self._drop_head(conn)  # stopping, or an idle connection: nothing to answer
                continue
            self.log.info("Request head not complete within %ss from ip=%s", self.limits.header_timeout,
                          conn.client[0] if isinstance(conn.client, tuple) else conn.client)
            self._drop_head(conn, problem_bytes(
                408, "Request Timeout",
                f"the request head was not complete within {self.limits.header_timeout:g} seconds"))

    # -- bounded socket waits in threads ---------------------------------------------------------------

    def handle_request(self, req: Any, conn: TConn) -> bool:
        # gthread made the socket blocking for this thread: bound every read and write of the response.
        conn.sock.settimeout(self.limits.io_timeout)
        try:
            return bool(super().handle_request(req, conn))
        except TimeoutError:
            self.log.info("Client stopped reading or sending for %ss; connection closed",
                          self.limits.io_timeout)
            raise StopIteration() from None

    # -- problem+json instead of gunicorn's HTML ---------------------------------------------------------

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        # (A ClientTimeout never gets here: gthread handles every OSError, TimeoutError included, itself.)
        captured = _Captured()
        # gunicorn picks the status, logs the request, and renders its page into `captured`.
        super().handle_error(req, captured, addr, exc)
        answer = _problem_from_html(captured.data)
        try:
            util.write_nonblock(client, answer)
        except Exception:
            self.log.debug("Failed to send error message.")


class AppLogsRequests(glogging.Logger):  # type: ignore[misc]  # gunicorn ships no type hints
    """gunicorn's logger without its access log: the app logs each request itself (``web.server.app``, with the
    build id and artifact key), and gunicorn's own line, though silenced by level, was still formatted for
    every request (its atoms: a few percent of a cache-hit submit's CPU in a profile)."""

    @property
    def access_log_enabled(self) -> bool:
        return False

    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        return None
