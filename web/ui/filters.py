"""Template filters of the UI: times in UTC with a relative hint, sizes, durations, shapes that never break
inside a token, and the documentation's `code` spans."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

from compilesvc.client.terminal_text import visible
from compilesvc.spec.keys import shape_text
from web.ui import bp


def _moment(value: str | datetime) -> datetime:
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def ago(seconds: float) -> str:
    """"3 min ago", "in 2 h": a hint beside an exact time, not a replacement for it."""
    future = seconds < 0
    span = duration(abs(seconds), coarse=True)
    return f"in {span}" if future else f"{span} ago"


@bp.app_template_filter("when")
def when(value: str | datetime | None, now: datetime | None = None) -> Markup:
    """An exact UTC time in a ``<time>`` element with a relative hint ("5 min ago"); the page's script keeps
    the hint current."""
    if value is None:
        return Markup("—")
    moment = _moment(value).astimezone(UTC)
    seconds = ((now or datetime.now(UTC)) - moment).total_seconds()
    return Markup('<time datetime="{iso}">{text}</time> <span class="ago" data-at="{iso}">{hint}</span>').format(
        iso=moment.isoformat(), text=moment.strftime("%Y-%m-%d %H:%M:%S UTC"), hint=ago(seconds))


@bp.app_template_filter("duration")
def duration(seconds: float | None, coarse: bool = False) -> str:
    """``0.4 s``, ``12 s``, ``4 min 05 s``, ``2 h 10 min``, ``3 d 4 h`` (``coarse``: the largest unit only)."""
    if seconds is None:
        return "—"
    if seconds < 10 and not coarse:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min" if coarse else f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h" if coarse else f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d" if coarse else f"{days} d {hours} h"


@bp.app_template_filter("filesize")
def filesize(size: int | None) -> str:
    if size is None:
        return "—"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


@bp.app_template_filter("codespans")
def codespans(text: str | None) -> Markup:
    """Markdown-style `code` spans as <code> (the OpenAPI descriptions use them); everything else escaped."""
    escaped = str(escape(text or ""))
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped))


@bp.app_template_filter("shape")
def shape(inputs: list[dict[str, Any]]) -> Markup:
    """Each input as one unbreakable token (``input_ids: int64[1, 128]``); lines break between inputs only."""
    return Markup(", ").join(Markup('<span class="nowrap">{}</span>').format(shape_text([i])) for i in inputs)


@bp.app_template_filter("seconds_between")
def seconds_between(end: str | datetime | None, start: str | datetime) -> float:
    """Seconds from ``start`` to ``end`` (to now when ``end`` is None: a running build's age)."""
    finish = _moment(end) if end is not None else datetime.now(UTC)
    return max((finish - _moment(start)).total_seconds(), 0.0)


@bp.app_template_filter("log_text")
def log_text(line: str | None) -> str:
    """A compiler line with its control characters as ``\\xNN`` text (:mod:`compilesvc.client.terminal_text`): a
    page shows what the compile wrote, and a copy pasted into a terminal carries no escape sequence."""
    return visible(line or "")
