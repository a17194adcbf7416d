"""The Stats page: how submits were answered over time, compile seconds by model and target, failures by
class and queue waits, for the last day or week (:mod:`compilesvc.insights.stats` computes them).

Charts are inline SVG laid out here (no script, no external asset): this module turns numbers into bar
geometry, the template draws it, titles each chart and shows the same numbers in a table beside it for
those who cannot see the chart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from flask import render_template, request

from compilesvc.access.tokens import Permission
from compilesvc.insights.stats import WINDOWS, Stats, UnknownWindow, collect
from web import readers
from web.context import web
from web.contract.access import access
from web.ui import bp
from web.ui.filters import duration

# Plot geometry in SVG user units; the SVG scales to the page width.
WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 8, 10, 26
ROW, LABEL_WIDTH = 22, 220
#: A horizontal chart's right margin: its last value label is centred on the plot's right edge, and half of
#: the widest ("2 min 30 s") must fit beside it.
VALUE_LABEL_RIGHT = 40


@dataclass(frozen=True)
class Series:
    name: str
    css: str  # the class giving its colour (style.css: .series-*)
    values: Sequence[float | None]


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


@dataclass(frozen=True)
class Tick:
    at: float  # y for a value axis, x for a category axis
    text: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    value_ticks: list[Tick]
    category_ticks: list[Tick]
    legend: list[Series]
    plot: tuple[float, float, float, float]  # x, y, width, height of the plotting area


# Axis maxima for durations whose halves read well too (1 min, 2 min 30 s, 10 min, 2 h, 12 h, …).
DURATION_TOPS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 43200, 86400)


def nice_ceiling(value: float, durations: bool = False) -> float:
    """The axis maximum, at least ``value``, with a round half (the middle tick): 2, 4, 6, 8 or 10 times a
    power of ten (at least 2: counts are whole), or for durations a round number of seconds, minutes, hours
    or days."""
    if durations and value <= DURATION_TOPS[-1]:
        return float(next(top for top in DURATION_TOPS if top >= value))
    unit = 86400 if durations else 1
    if value <= 2 * unit:
        return 2.0 * unit
    power = 10 ** math.floor(math.log10(value / unit))
    return float(next(step * power for step in (2, 4, 6, 8, 10) if step * power * unit >= value) * unit)


def _count(value: float) -> str:
    return f"{value:g}"


def axis_seconds(value: float) -> str:
    """A duration tick: in the largest unit that divides it ("0", "30 s", "2 min 30 s", "4 h")."""
    if value == 0:
        return "0"
    if value < 10:
        return f"{value:g} s"
    for unit, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if value >= unit and value % unit == 0:
            return f"{value / unit:g} {name}"
    return duration(value)


def column_chart(labels: Sequence[str], series: Sequence[Series], *, stacked: bool,
                 fmt: Callable[[float], str] = _count, axis: Callable[[float], str] | None = None) -> Chart:
    """Vertical bars per category (the time bins): stacked, or side by side."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = nice_ceiling(_peak(series, len(labels), stacked), durations=axis is axis_seconds)
    slot = plot_w / max(len(labels), 1)
    gap = slot * 0.15
    bars: list[Bar] = []
    for i, k, one, value, below in _segments(labels, series, stacked):
        height, base = value / top * plot_h, below / top * plot_h
        if stacked:
            x, width = LEFT + i * slot + gap, slot - 2 * gap
        else:
            width = (slot - 2 * gap) / len(series)
            x = LEFT + i * slot + gap + k * width
        bars.append(Bar(round(x, 1), round(TOP + plot_h - (base + height), 1), round(width, 1), round(height, 1),
                        one.css, f"{labels[i]}: {one.name} {fmt(value)}"))
    every = max(1, math.ceil(len(labels) / 12))  # at most a dozen labels fit under the axis
    categories = [Tick(round(LEFT + (i + 0.5) * slot, 1), label) for i, label in enumerate(labels) if i % every == 0]
    values = [Tick(round(TOP + plot_h * (1 - f), 1), (axis or fmt)(top * f)) for f in (0.0, 0.5, 1.0)]
    return Chart(WIDTH, HEIGHT, bars, values, categories, list(series), (LEFT, TOP, plot_w, plot_h))


def _segments(labels: Sequence[str], series: Sequence[Series], stacked: bool
              ) -> Iterator[tuple[int, int, Series, float, float]]:
    """Each bar to draw: (category, series index, series, value, the values stacked below it: 0 unless
    ``stacked``), categories in order, zero and missing values skipped."""
    for i in range(len(labels)):
        below = 0.0
        for k, one in enumerate(series):
            value = one.values[i]
            if not value:
                continue
            yield i, k, one, value, below
            if stacked:
                below += value


def _peak(series: Sequence[Series], categories: int, stacked: bool) -> float:
    """The largest bar: a category's sum when stacked, else the largest single value."""
    if stacked:
        return max((sum(s.values[i] or 0 for s in series) for i in range(categories)), default=0.0)
    return max((v or 0 for s in series for v in s.values), default=0.0)


def bar_chart(labels: Sequence[str], series: Sequence[Series], *, stacked: bool,
              fmt: Callable[[float], str] = _count, axis: Callable[[float], str] | None = None) -> Chart:
    """Horizontal bars per category (models and targets, error classes): stacked, or one under another."""
    lanes = 1 if stacked else len(series)
    height = TOP + BOTTOM + ROW * lanes * max(len(labels), 1)
    plot_w, plot_h = WIDTH - LABEL_WIDTH - VALUE_LABEL_RIGHT, height - TOP - BOTTOM
    top = nice_ceiling(_peak(series, len(labels), stacked), durations=axis is axis_seconds)
    bars: list[Bar] = []
    for i, k, one, value, below in _segments(labels, series, stacked):
        lane = 0 if stacked else k
        bars.append(Bar(round(LABEL_WIDTH + below / top * plot_w, 1), TOP + (i * lanes + lane) * ROW + 3,
                        round(value / top * plot_w, 1), ROW - 6, one.css, f"{labels[i]}: {one.name} {fmt(value)}"))
    categories = [Tick(TOP + (i * lanes + lanes / 2) * ROW + 4, label) for i, label in enumerate(labels)]
    values = [Tick(round(LABEL_WIDTH + plot_w * f, 1), (axis or fmt)(top * f)) for f in (0.0, 0.5, 1.0)]
    return Chart(WIDTH, height, bars, values, categories, list(series), (LABEL_WIDTH, TOP, plot_w, plot_h))


def _seconds(value: float) -> str:
    return duration(value, coarse=value >= 60)


def bin_label(start: datetime, window: str) -> str:
    return start.strftime("%H:00") if window == "day" else start.strftime("%b %d")


def charts(stats: Stats) -> dict[str, Chart]:
    span = stats.window
    labels = [bin_label(start, span.name) for start in span.bins]
    outcomes = stats.outcomes
    waits = [p for _, p in stats.queue_wait.bins]
    times = stats.compile_times
    return {
        "outcomes": column_chart(labels, [
            Series("hit", "series-hit", [b.hit for b in outcomes]),
            Series("joined", "series-joined", [b.joined for b in outcomes]),
            Series("partly reused", "series-partly", [b.partly_reused for b in outcomes]),
            Series("built", "series-built", [b.built for b in outcomes]),
        ], stacked=True),
        "queue_wait": column_chart(labels, [
            Series("p50", "series-p50", [p.p50 for p in waits]),
            Series("p95", "series-p95", [p.p95 for p in waits]),
        ], stacked=False, fmt=_seconds, axis=axis_seconds),
        "compile_times": bar_chart([f"{c.model_name or '(no name)'} · {c.target}" for c in times], [
            Series("p50", "series-p50", [c.seconds.p50 for c in times]),
            Series("p95", "series-p95", [c.seconds.p95 for c in times]),
        ], stacked=False, fmt=_seconds, axis=axis_seconds),
        "failures": bar_chart([f.error_class for f in stats.failures], [
            Series("retried", "series-retried", [f.retried for f in stats.failures]),
            Series("final", "series-final", [f.final for f in stats.failures]),
        ], stacked=True),
    }


@bp.get("/stats")
@access(Permission.READ)
def stats_page() -> tuple[str, int]:
    name = request.args.get("window", "day")
    try:
        with web().services.sessions() as session:
            stats = collect(session, name, reader=readers.reader())
    except UnknownWindow as exc:
        return render_template("stats.html", stats=None, error=str(exc), windows=list(WINDOWS), current=None), 400
    return render_template("stats.html", stats=stats, charts=charts(stats), error=None, windows=list(WINDOWS),
                           current=name, bin_label=bin_label), 200
