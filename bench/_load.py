"""HTTP load for the API benches (not a bench itself): wrk for throughput, threads for submit bursts.

:func:`run_wrk` drives one endpoint with ``wrk`` (:mod:`bench._wrk`: keep-alive connections, latency percentiles);
:func:`run_python_client` stands in where wrk is not installed (one process per connection: slower, so its
ratios mean more than its absolute numbers). :func:`stream` keeps N clients submitting one request after
another for a while, and returns every request's latency and status (bursts released together across client
processes are :mod:`bench._submit_clients`').
"""

from __future__ import annotations

import http.client
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench import _wrk


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str
    body: bytes | None = None


@dataclass(frozen=True)
class Result:
    name: str
    requests_per_second: float
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    requests: int = 0
    server_cpu_seconds: float = 0.0

    @property
    def cpu_us_per_request(self) -> float:
        return self.server_cpu_seconds / self.requests * 1e6 if self.requests else float("nan")

    @property
    def latency(self) -> str:
        if self.p50_ms is None or self.p99_ms is None:
            return "n/a (python client)"
        return f"p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms"


def run_wrk(base: str, endpoint: Endpoint, headers: dict[str, str], duration: float, connections: int,
            threads: int) -> Result:
    load = _wrk.run_wrk(base + endpoint.path, seconds=duration, connections=connections, threads=threads,
                        headers=headers, method=endpoint.method, body=endpoint.body)
    return Result(endpoint.name, load.rps, load.errors, load.p50_ms, load.p99_ms, load.requests)


def _client(args: tuple[int, Endpoint, dict[str, str], float]) -> tuple[int, int]:
    port, endpoint, headers, deadline = args
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {**headers, **({"Content-Type": "application/json"} if endpoint.body is not None else {})}
    done = errors = 0
    while time.monotonic() < deadline:
        conn.request(endpoint.method, endpoint.path, body=endpoint.body, headers=headers)
        response = conn.getresponse()
        response.read()
        errors += response.status >= 300
        done += 1
    conn.close()
    return done, errors


def run_python_client(base: str, endpoint: Endpoint, headers: dict[str, str], duration: float,
                      connections: int) -> Result:
    """Without wrk: one keep-alive connection per process, all starting together."""
    port = int(base.rsplit(":", 1)[1])
    start = time.monotonic() + 0.5
    deadline = start + duration
    with multiprocessing.get_context("spawn").Pool(connections) as pool:
        results = pool.map(_client, [(port, endpoint, headers, deadline)] * connections)
    done = sum(r[0] for r in results)
    return Result(endpoint.name, done / (time.monotonic() - start), sum(r[1] for r in results), None, None, done)


#: One request's (seconds, HTTP status); status 0 when the connection failed.
Timing = tuple[float, int]


def _send(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]) -> Timing:
    started = time.perf_counter()
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        status = response.status
    except OSError:
        status = 0
    return time.perf_counter() - started, status


def stream(port: int, path: str, next_body: Callable[[], bytes], headers: dict[str, str], clients: int,
           seconds: float) -> list[Timing]:
    """``clients`` connections, each POSTing ``next_body()`` one request after another for ``seconds``."""
    headers = {**headers, "Content-Type": "application/json"}
    deadline = time.monotonic() + seconds
    timings: list[Timing] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < deadline:
            with lock:
                body = next_body()
            timings.append(_send(conn, path, body, headers))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (the stats page's definition)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]
