"""The one table of ``make bench``: each bench records its figures here; :mod:`bench.run_all` prints them together.

A bench calls :func:`record` once per figure, beside its own detailed output. When the bench runs under
``bench.run_all``, the figure is appended as one JSON line to the file named by ``COMPILESVC_BENCH_RESULTS``;
run on its own, it is only printed. :func:`render` turns the collected figures into the Markdown table that
``make bench`` prints last and docs/benchmarks.md carries.

A figure is a value with its unit and, where the issue or a doc sets one, its target as a comparison
(``>=`` or ``<=``) and a bound; ``met`` is then decided here, once, for every bench. ``vs`` says what the value
is measured against ("static JSON on the same server", "boto3 upload_file to the same S3 server"): a ratio
without its baseline means nothing. ``note`` is a short explanation (a miss's reason, the host's load).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

#: The environment variable naming the JSON-lines file figures are appended to (set by bench.run_all).
RESULTS_ENV = "COMPILESVC_BENCH_RESULTS"


@dataclass(frozen=True)
class Figure:
    bench: str
    name: str
    value: float
    unit: str
    target: float | None = None
    comparison: str | None = None  # ">=" or "<="
    vs: str = ""
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or self.comparison is None:
            return None
        return self.value >= self.target if self.comparison == ">=" else self.value <= self.target


def record(bench: str, name: str, value: float, unit: str, *, at_least: float | None = None,
           at_most: float | None = None, vs: str = "", note: str = "") -> Figure:
    """Record one figure (and print it as one line); returns it, so the caller can act on ``met``."""
    if at_least is not None and at_most is not None:
        raise ValueError("a figure has one target: at_least or at_most")
    target, comparison = (at_least, ">=") if at_least is not None else (at_most, "<=") if at_most is not None \
        else (None, None)
    figure = Figure(bench, name, float(value), unit, target, comparison, vs, note)
    print(f"figure: {_row(figure)}", flush=True)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(figure)) + "\n")
    return figure


def load(path: Path) -> list[Figure]:
    if not path.exists():
        return []
    return [Figure(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def machine() -> str:
    """One line naming the host: cores, memory and load at the time of the call."""
    cores = os.cpu_count() or 0
    try:
        memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal:"))
        memory = f", {memory_kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = ""
    load1, load5, _ = os.getloadavg()
    return f"{cores} cores{memory}, {platform.machine()}, Python {platform.python_version()}, " \
           f"load {load1:.2f} / {load5:.2f} (1 / 5 min)"


def _format(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if value == int(value) and abs(value) < 1e15:  # a count (errors, builds, compiles) is a whole number
        return f"{int(value)} {unit}".rstrip()
    magnitude = abs(value)
    digits = 0 if magnitude >= 100 else 1 if magnitude >= 10 else 2 if magnitude >= 0.1 or magnitude == 0 else 3
    return f"{value:.{digits}f} {unit}".rstrip()


def _target(figure: Figure) -> str:
    if figure.target is None:
        return ""
    return f"{figure.comparison} {_format(figure.target, figure.unit)}"


def _verdict(figure: Figure) -> str:
    return {None: "", True: "met", False: "MISSED"}[figure.met]


def _row(figure: Figure) -> str:
    cells = (figure.bench, figure.name, _format(figure.value, figure.unit), _target(figure), _verdict(figure),
             figure.vs, figure.note)
    return " | ".join(cell.replace("|", "\\|") for cell in cells)  # a note's own pipe must not split its cell


def render(figures: list[Figure], host: str) -> str:
    """The Markdown table of every figure, in recording order, under a line naming the host."""
    lines = [f"Host: {host}", "",
             "| bench | figure | value | target | | against | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {_row(figure)} |" for figure in figures]
    return "\n".join(lines)


def missed(figures: list[Figure]) -> list[Figure]:
    return [figure for figure in figures if figure.met is False]
