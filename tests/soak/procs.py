"""Resident memory and open files of the soak's long-lived processes, from Linux's /proc, and their growth.

A :class:`Sample` is one moment: for every process of the stack, its RSS (``VmRSS``) and its number of open
file descriptors (entries of ``/proc/PID/fd``), keyed by a stable name: ``api master``, ``api worker
<pid>`` (each gunicorn worker: named by pid, so a replaced one is told from its replacement), ``relay``,
``w1``/``w2`` (worker main processes), ``nginx master``, ``nginx worker <pid>``. A worker's compile
children come and go with each compile, so they are counted (``w1 children``), not measured: after the
load has drained, a worker has none left (a child still alive then is a leak of its own kind).

:func:`growth` compares two samples process by process; a process present in only one of them (gunicorn
replaced a worker) is reported as such, never silently compared with another.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from tests.soak.stack import SoakStack


@dataclass(frozen=True)
class ProcessFigures:
    pid: int
    rss_kib: int
    fds: int


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, in pid order (Linux /proc; none when it is gone)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def figures(pid: int) -> ProcessFigures | None:
    """RSS and open fds of ``pid``, or None when it is gone (or a zombie: it holds neither)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return None if rss is None else ProcessFigures(pid, rss, fds)


Sample = dict[str, ProcessFigures]


def sample(stack: SoakStack) -> tuple[Sample, dict[str, int]]:
    """Every long-lived process's figures, and the number of live descendants of each compile worker."""
    named: dict[str, int] = {"api master": stack.api.proc.pid, "relay": stack.relay.proc.pid}
    for pid in children(stack.api.proc.pid):
        named[f"api worker {pid}"] = pid
    nginx = stack.nginx_pid()
    named["nginx master"] = nginx
    for pid in children(nginx):
        named[f"nginx worker {pid}"] = pid
    counts: dict[str, int] = {}
    for worker in stack.workers:
        named[worker.name] = worker.proc.pid
        counts[f"{worker.name} children"] = len(descendants(worker.proc.pid))
    out: Sample = {}
    for name, pid in named.items():
        found = figures(pid)
        if found is not None:
            out[name] = found
    return out, counts


def kind(name: str) -> str:
    """The kind a process name belongs to: "api worker 4242" -> "api worker", "w1" -> "worker"."""
    if name.startswith(("api worker", "nginx worker")):
        return name.rsplit(" ", 1)[0]
    if name.startswith("w") and name[1:].isdigit():
        return "worker"
    return name


@dataclass(frozen=True)
class Growth:
    name: str
    start: ProcessFigures | None
    end: ProcessFigures | None

    @property
    def same_process(self) -> bool:
        return self.start is not None and self.end is not None and self.start.pid == self.end.pid

    @property
    def rss_kib(self) -> int:
        return self.end.rss_kib - self.start.rss_kib if self.same_process else 0  # type: ignore[union-attr]

    @property
    def fds(self) -> int:
        return self.end.fds - self.start.fds if self.same_process else 0  # type: ignore[union-attr]


def growth(start: Sample, end: Sample) -> list[Growth]:
    return [Growth(name, start.get(name), end.get(name)) for name in sorted({*start, *end}, key=_order)]


def _order(name: str) -> tuple[int, int, str]:
    rank = {"api m": 0, "api": 1, "rel": 2, "w": 3, "nginx m": 4, "ngi": 5}
    number = name.rsplit(" ", 1)[-1]
    return next((r for p, r in rank.items() if name.startswith(p)), 9), int(number) if number.isdigit() else 0, name


def table(rows: list[Growth]) -> str:
    """A plain-text table: per process, RSS and fds at both samples and the difference."""
    lines = [f"{'process':<18} {'pid':>7} {'RSS start':>10} {'RSS end':>10} {'RSS +':>9} "
             f"{'fds start':>9} {'fds end':>7} {'fds +':>6}"]
    for row in rows:
        if not row.same_process:
            what = "gone by the end" if row.end is None else "started after the first sample"
            lines.append(f"{row.name:<18} {'':>7} {what}")
            continue
        assert row.start is not None and row.end is not None
        start, end = row.start.rss_kib / 1024, row.end.rss_kib / 1024
        lines.append(f"{row.name:<18} {row.end.pid:>7} {start:>8.1f}Mi {end:>8.1f}Mi {end - start:>+7.1f}Mi "
                     f"{row.start.fds:>9} {row.end.fds:>7} {row.fds:>+6}")
    return "\n".join(lines)
