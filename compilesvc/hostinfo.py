"""Facts about the host a process runs on: CPU instruction set, instance type, memory.

The cpu target's AOTInductor code is built for the compiling host's vector ISA, so that ISA is part of the
artifact key and of the queue a compile is routed to. It is read from /proc/cpuinfo (no torch needed, so
the API host and the worker agree on it).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from functools import cache
from pathlib import Path

# The vector ISA levels inductor chooses between, best first, with the cpu flags each needs.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
_X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    # Inductor emits AMX tile kernels when the compiling host has them (-march=native), and such code
    # dies on an AVX-512 host without AMX: AMX hosts are their own level, so they never share a key.
    ("avx512_amx", _AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}),
    ("avx512", _AVX512),
    ("avx2", frozenset({"avx2", "fma"})),
)


def _cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def isa_from_cpuinfo(machine: str, cpuinfo: str) -> str:
    """``<arch>-<level>`` for a machine name and /proc/cpuinfo text, e.g. ``x86_64-avx512``."""
    arch = machine.lower().replace("amd64", "x86_64").replace("arm64", "aarch64")
    # The result goes into keys and queue names as <arch>-<level>: keep the arch to [a-z0-9_] and never
    # empty (platform.machine() returns "" when it cannot tell).
    arch = re.sub(r"[^a-z0-9_]", "_", arch) or "unknown"
    flags = _cpu_flags(cpuinfo)
    if arch == "x86_64":
        for level, needed in _X86_LEVELS:
            if needed <= flags:
                return f"{arch}-{level}"
        return f"{arch}-default"
    if arch == "aarch64":
        return f"{arch}-sve" if "sve" in flags else f"{arch}-neon"
    return f"{arch}-default"


@cache
def host_isa() -> str:
    """This host's ISA identifier (see :func:`isa_from_cpuinfo`)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return isa_from_cpuinfo(platform.machine(), cpuinfo)


@cache
def instance_type() -> str | None:
    """The EC2 instance type if the host exposes it without a network call (DMI product name)."""
    for path in ("/sys/devices/virtual/dmi/id/product_name", "/sys/class/dmi/id/product_name"):
        try:
            name = Path(path).read_text().strip()
        except OSError:
            continue
        if "." in name and name.split(".")[0].isalnum():
            return name
    return None


def host_memory_bytes() -> int | None:
    """The memory this process may use: the host's total (``MemTotal`` of /proc/meminfo, else sysconf), or
    its cgroup's limit where that is lower. Inside a container /proc/meminfo reports the node's memory, not
    the pod's limit: a compile sized by it would be OOM-killed by the kernel instead. None if unknown."""
    total: int | None = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024  # the kernel reports kB
                break
    if total is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    if limit is None:
        return total
    return limit if total is None else min(total, limit)


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The tightest memory limit on this process's cgroup and its ancestors (cgroup v2 ``memory.max``, or v1
    ``memory.limit_in_bytes``), or None where there is none. Ancestors count: a pod's limit is set on the
    pod's cgroup, its containers sit below it."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            base, name = root, "memory.max"  # v2 (the unified hierarchy, or a hybrid host's unified mount)
            if not (base / "cgroup.controllers").exists():
                base = root / "unified"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        limits += _limits_up(base, path, name)
    return min(limits) if limits else None


#: v1 writes "no limit" as the largest page-aligned 63-bit number; anything near it is no limit.
_NO_LIMIT = 1 << 62


def _limits_up(base: Path, path: str, name: str) -> list[int]:
    """``name`` in the cgroup at ``path`` under ``base`` and in each ancestor up to ``base``. Inside a
    cgroup namespace the path may not exist under this mount (it is then ``/``, the container's own)."""
    found: list[int] = []
    directory = base / path.strip("/")
    while True:
        with contextlib.suppress(OSError, ValueError):
            text = (directory / name).read_text().strip()
            if text != "max" and int(text) < _NO_LIMIT:
                found.append(int(text))
        if directory == base or base not in directory.parents:
            return found
        directory = directory.parent


#: Each architecture's ISA levels, most capable first: code built for a level runs on that level and above.
_LEVEL_ORDER = {"x86_64": [level for level, _ in _X86_LEVELS] + ["default"], "aarch64": ["sve", "neon"]}


def isa_runs_on(built_for: str, host: str) -> bool:
    """Whether code built for ISA ``built_for`` (``<arch>-<level>``) runs on a host of ISA ``host``."""
    if built_for == host:
        return True
    arch, _, level = built_for.partition("-")
    host_arch, _, host_level = host.partition("-")
    order = _LEVEL_ORDER.get(arch)
    if arch != host_arch or order is None or level not in order or host_level not in order:
        return False
    return order.index(host_level) <= order.index(level)
