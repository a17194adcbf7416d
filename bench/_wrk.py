"""One load run of ``wrk`` against one URL (not a bench itself): the load generator of the API benches, written in
C so the client is not what is measured on a small host. ``make test-tools`` installs it.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


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

    @property
    def p50_ms(self) -> float:
        return _ms(self.p50)

    @property
    def p99_ms(self) -> float:
        return _ms(self.p99)


def _ms(text: str) -> float:
    """wrk's latency ("812.00us", "9.67ms", "1.02s") in milliseconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"not a wrk latency: {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def run_wrk(url: str, *, seconds: float, connections: int, threads: int = 2,
            headers: dict[str, str] | None = None, method: str = "GET", body: bytes | None = None) -> Load:
    """``connections`` keep-alive connections sending ``method url`` (with ``body``, as JSON) for ``seconds``."""
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"]
    for name, value in (headers or {}).items():
        command += ["-H", f"{name}: {value}"]
    with tempfile.TemporaryDirectory(prefix="compilesvc-wrk-") as scratch:
        if method != "GET" or body is not None:  # only a script sets wrk's method and body
            script = Path(scratch) / "request.lua"
            lines = [f'wrk.method = "{method}"']
            if body is not None:
                lines += [f"wrk.body = {json.dumps(body.decode())}", 'wrk.headers["Content-Type"] = "application/json"']
            script.write_text("\n".join(lines) + "\n")
            command += ["-s", str(script)]
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
