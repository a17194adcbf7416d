"""Structured logging for every compilesvc process: one JSON object per line.

Each line has ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and ``msg``, plus every
``extra=`` field the caller passed (``build_id``, ``bucket_key``, ``artifact_key``, ``worker`` …) and any
static fields given to :func:`configure` (``service`` = api | worker | relay). Exceptions come out as
one ``exc`` string, so a traceback never spans lines and a log shipper needs no multi-line parsing.

Usage::

    from compilesvc import jsonlog
    jsonlog.configure(service="api")                  # once, at process start
    log.info("artifact published", extra={"artifact_key": key})

:func:`gunicorn_logconfig` gives the same format to gunicorn's own loggers (``logconfig_dict``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

__all__ = ["JsonFormatter", "configure", "gunicorn_logconfig", "level_from_env"]

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",  # 3.12+, listed so upgrades do not start leaking it
}
_CORE_FIELDS = ("ts", "level", "logger", "msg")
#: Marks the handler :func:`configure` installed, so calling it again replaces rather than stacks.
_HANDLER_FLAG = "_compilesvc_jsonlog"


def _fallback(value: object) -> object:
    """JSON for values json cannot encode natively: sets as lists, everything else as ``str()``."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of compact JSON. Never raises: a field that cannot be encoded
    is logged as its ``repr`` rather than losing the line."""

    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        # strftime + msecs is several times cheaper than datetime.isoformat, and the API logs a line
        # per request on its hot path.
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        data: dict[str, Any] = {
            "ts": ts,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in self.static.items():
            data.setdefault(key, value)
        for key, value in record.__dict__.items():
            if key in _RECORD_ATTRS or key.startswith("_"):
                continue
            # A caller's extra named like a core field must not overwrite it (a forged "level").
            data["extra_" + key if key in _CORE_FIELDS else key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            data["exc"] = record.exc_text
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        try:
            return json.dumps(data, default=_fallback, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError):  # circular or otherwise unencodable extras
            safe = {key: value if key in _CORE_FIELDS else repr(value) for key, value in data.items()}
            return json.dumps(safe, ensure_ascii=False, separators=(",", ":"))


def level_from_env(default: str = "INFO") -> str:
    """The log level from ``COMPILESVC_LOG_LEVEL`` (DEBUG, INFO, WARNING …), else ``default``."""
    level = os.environ.get("COMPILESVC_LOG_LEVEL", default).strip().upper() or default
    return level if isinstance(logging.getLevelName(level), int) else default


def configure(
    level: int | str | None = None,
    *,
    stream: IO[str] | None = None,
    service: str | None = None,
    static: Mapping[str, Any] | None = None,
) -> logging.Handler:
    """Send all logging (the root logger) to ``stream`` (default stderr) as JSON lines.

    Idempotent: a handler installed by an earlier call is replaced, other handlers are left alone.
    ``service`` and ``static`` add fields to every line. Returns the installed handler.
    """
    fields = dict(static or {})
    if service is not None:
        fields["service"] = service
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(fields))
    setattr(handler, _HANDLER_FLAG, True)
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, _HANDLER_FLAG, False):
            root.removeHandler(existing)
            existing.close()
    root.addHandler(handler)
    root.setLevel(level if level is not None else level_from_env())
    logging.captureWarnings(True)  # warnings.warn(...) becomes a JSON line too
    return handler


def gunicorn_logconfig(level: str = "INFO", service: str = "api") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for gunicorn's ``logconfig_dict``: its error log as JSON lines on
    stderr, its access log silenced (the API logs its own, richer, request lines)."""
    formatter = {"()": f"{__name__}.JsonFormatter", "static": {"service": service}}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": formatter},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
        },
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": {"level": level, "handlers": ["stderr"], "propagate": False},
            "gunicorn.access": {"level": "CRITICAL", "handlers": [], "propagate": False},
        },
    }
