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
    """The host's total memory (``MemTotal`` of /proc/meminfo, else sysconf), or None if unknown."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


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
