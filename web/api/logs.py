"""``/v1/builds/{id}/logs``: a build's compile log, by page (for polling) and live (Server-Sent Events)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, Response, current_app, g
from sqlalchemy.exc import SQLAlchemyError

from compilesvc.access.team_reads import Reader
from compilesvc.access.tokens import Permission
from compilesvc.compiles.logs import read_build_logs
from compilesvc.states import BuildState
from web import readers
from web.api.params import respond
from web.api.serialize import log_json
from web.context import WebContext, web
from web.contract.inputs import LogsQuery, StreamHeaders, StreamQuery
from web.contract.openapi import operation
from web.contract.problems import Problem
from web.contract.schemas import LogPage

log = logging.getLogger(__name__)
bp = Blueprint("logs", __name__, url_prefix="/v1/builds")

SSE_BATCH = 500
#: One event of the live log, as OpenAPI describes a text/event-stream's events (3.2's itemSchema; in 3.1,
#: the media type's schema). The first frame sets ``retry`` only; keep-alive comments are no events.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"enum": ["line", "end"]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "description": "line: a log line as in /logs; end: {state, after}"},
        "id": {"type": "string", "description": "The line id (line events)."},
        "retry": {"type": "integer", "minimum": 0},
    },
}


def _build_state(ctx: WebContext, build_id: int, who: Reader) -> str | None:
    with ctx.services.sessions() as session:
        return readers.build_state(session, who, build_id)


@bp.get("/<ledger_id:build_id>/logs")
@operation(summary="Compile log lines of a build, in order", tag="logs", query=LogsQuery, access=Permission.READ,
           description="A page of the central log of every compile of the build (each line names its bucket "
                       "key, attempt and stream). Poll with `after` set to the previous `next_after`; "
                       "`finished` is true once the build is over and every line was returned.",
           responses={200: LogPage}, problems=(400, 404))
def logs(build_id: int, query: LogsQuery) -> Response:
    g.build_id = build_id
    ctx = web()
    after, limit = query.after, query.limit
    # State before lines: if the build was finished when we looked, every line it will ever have was
    # committed before that, so the read below sees them all and `finished` is exact.
    state = _build_state(ctx, build_id, readers.reader())
    if state is None:
        raise readers.no_build(build_id)
    with ctx.services.sessions() as session:
        entries = read_build_logs(session, build_id, after=after, limit=limit)
    next_after = entries[-1].id if entries else after
    return respond(LogPage, {
        "build_id": build_id, "build_state": state, "lines": [log_json(e) for e in entries],
        "next_after": next_after, "finished": state != BuildState.BUILDING and len(entries) < limit,
    })


@bp.get("/<ledger_id:build_id>/logs/stream")
@operation(summary="Live compile log (Server-Sent Events)", tag="logs", access=Permission.READ,
           description="`line` events carry a log line (JSON, as in /logs) with the line id as the event id, "
                       "so a reconnecting EventSource resumes after Last-Event-ID. An `end` event "
                       "(data: {state}) closes the stream once the build finished and every line was sent. "
                       "Streams are closed after a bounded lifetime; clients reconnect.",
           query=StreamQuery, headers=StreamHeaders,
           responses={200: ("text/event-stream", SSE_EVENT)}, problems=(400, 404, 503))
def stream_logs(build_id: int, query: StreamQuery, headers: StreamHeaders) -> Response:
    g.build_id = build_id
    ctx = web()
    after = headers.last_event_id if headers.last_event_id is not None else query.after
    who = readers.reader()
    if _build_state(ctx, build_id, who) is None:
        raise readers.no_build(build_id)
    # Each open stream holds a server thread for its lifetime: past the cap, refuse rather than let
    # watchers starve the API (the UI then polls /logs instead).
    if not ctx.streams.acquire(blocking=False):
        raise Problem("too-many-streams", "too many live log streams on this server; poll /logs instead",
                      headers={"Retry-After": "10"})
    config = current_app.config
    events = _sse_events(ctx, build_id, who, after, poll=float(config["SSE_POLL_SECONDS"]),
                         lifetime=float(config["SSE_MAX_SECONDS"]),
                         heartbeat=float(config["SSE_HEARTBEAT_SECONDS"]))
    return Response(_Releasing(events, ctx.streams.release), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Releasing:
    """A response iterable that calls ``release`` exactly once when the server closes it (WSGI servers
    always call ``close()``), even if the stream was never iterated: a generator's own ``finally`` would
    not run then."""

    def __init__(self, inner: Iterator[str], release: Callable[[], None]):
        self._inner = inner
        self._release: Callable[[], None] | None = release

    def __iter__(self) -> Iterator[str]:
        return self._inner

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


def _sse_events(ctx: WebContext, build_id: int, who: Reader, after: int, *, poll: float, lifetime: float,
                heartbeat: float) -> Iterator[str]:
    """Poll the ledger and yield SSE frames. Holds no database connection between polls."""
    deadline = time.monotonic() + lifetime
    last_sent = time.monotonic()
    yield f"retry: {int(max(poll, 1.0) * 1000)}\n\n"
    while True:
        try:
            state = _build_state(ctx, build_id, who)
            with ctx.services.sessions() as session:
                entries = read_build_logs(session, build_id, after=after, limit=SSE_BATCH)
        except SQLAlchemyError as exc:
            # The status line went out long ago: end the stream; the client resumes after its last id.
            log.warning("log stream ended by a ledger error",
                        extra={"build_id": build_id, "error": f"{type(exc).__name__}: {exc}"})
            return
        if state is None:  # deleted while we streamed
            yield _frame("end", {"state": "unknown"})
            return
        for entry in entries:
            yield _frame("line", log_json(entry), entry.id)
            after = entry.id
        if entries:
            last_sent = time.monotonic()
        if state != BuildState.BUILDING and len(entries) < SSE_BATCH:
            yield _frame("end", {"state": state, "after": after})
            return
        if len(entries) == SSE_BATCH:
            continue  # a backlog: drain it before sleeping
        now = time.monotonic()
        if now >= deadline:
            return  # bounded lifetime: the client's EventSource reconnects with Last-Event-ID
        if now - last_sent >= heartbeat:
            yield ": keep-alive\n\n"  # a comment: keeps proxies from timing out an idle stream
            last_sent = now
        time.sleep(min(poll, max(0.0, deadline - now)))


def _frame(event: str, data: dict[str, Any], event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
