"""CPU time and memory of processes, from Linux's /proc (shared by the benches; not a bench itself)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path


def cpu_seconds(selected: Callable[[int, list[str]], bool], *, with_children: bool = False) -> float:
    """User + system CPU seconds of every process ``selected(pid, stat_fields)`` picks; with
    ``with_children`` also what its waited-for children used. ``stat_fields`` are /proc/PID/stat's fields
    after the command name: [0] state, [1] ppid, [2] pgrp, [11] utime, [12] stime, [13] cutime, [14] cstime.
    """
    last = 15 if with_children else 13
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if selected(int(entry.name), fields):
            ticks += sum(int(value) for value in fields[11:last])
    return ticks / os.sysconf("SC_CLK_TCK")


def children(parent: int) -> list[int]:
    """The pids of ``parent``'s children (gunicorn's workers, for one), in order."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except OSError:
                continue
    return sorted(found)


def cpu_of_each(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each of ``pids`` (0 for one that is gone)."""
    return [cpu_seconds(lambda pid, _fields, wanted=wanted: pid == wanted) for wanted in pids]


def status_kib(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/PID/status (``VmRSS``, ``VmHWM``), in KiB; 0 when the process has none (a zombie)."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0
