"""One load run of ``wrk`` against one URL (not a bench itself): the load generator of benches that compare two
servers' answers to GETs, written in C so the client is not what is measured on a small host.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    requests: int
    rps: float
    errors: int  # non-2xx/3xx answers and socket errors
    p50: str  # as wrk prints them ("1.23ms")
    p99: str

    @property
    def seconds_per_request(self) -> float:
        return 1.0 / self.rps if self.rps else float("inf")


def run_wrk(url: str, *, seconds: float, connections: int, threads: int = 2,
            headers: dict[str, str] | None = None) -> Load:
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"]
    for name, value in (headers or {}).items():
        command += ["-H", f"{name}: {value}"]
    out = subprocess.run([*command, url], capture_output=True, text=True, check=True).stdout

    def found(pattern: str) -> str:
        match = re.search(pattern, out, re.M)
        if match is None:
            raise RuntimeError(f"wrk's output has no {pattern!r}:\n{out}")
        return match.group(1)

    errors = 0
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        errors += int(non2xx.group(1))
    socket_errors = re.search(r"Socket errors: (.*)", out)
    if socket_errors:
        errors += sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1)))
    return Load(int(found(r"(\d+) requests in")), float(found(r"Requests/sec:\s+([\d.]+)")), errors,
                found(r"^\s+50%\s+(\S+)"), found(r"^\s+99%\s+(\S+)"))
