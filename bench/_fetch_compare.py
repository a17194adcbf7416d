"""What a fleet's boot is compared with (not a bench itself): ``curl`` each presigned URL of an artifact, then
``sha256sum`` the files; the median timing of either side; and one printed, recorded ratio row.

Shared by :mod:`bench.fleet_fetch` (small artifacts, many rounds) and :mod:`bench.llm_artifact` (one LLM-shaped
directory of 4 GiB), so both set ``compilesvc fetch`` against the same baseline, measured the same way.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._table import record


def median_seconds(fn: Callable[[], Any], rounds: int) -> float:
    """The median wall time of ``rounds`` calls of ``fn``."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compare_row(bench: str, name: str, value: float, baseline_name: str, baseline: float, target: float,
                note: str = "") -> bool:
    """Print and record ``value / baseline`` (seconds both) against ``target`` (at most); True when met."""
    ratio = value / baseline if baseline else float("inf")
    ok = ratio <= target
    print(f"{name:<34} {value * 1000:9.1f} ms   {baseline_name:<34} {baseline * 1000:9.1f} ms   "
          f"ratio {ratio:5.2f} (target <= {target:.2f}) {'ok' if ok else 'MISSED'}", flush=True)
    record(bench, name, ratio, "x", at_most=target, vs=baseline_name,
           note=f"{value * 1000:.0f} ms vs {baseline * 1000:.0f} ms" + (f"; {note}" if note else ""))
    return ok


def curl_and_sha256sum(described: dict[str, Any], out: Path) -> None:
    """What a boot script does without ``compilesvc fetch``: ``curl`` every file of the artifact ``described``
    (GET /v1/artifacts/{key}'s answer, presigned URLs) into ``out`` (emptied first), then ``sha256sum`` them all.
    Files keep their paths (``weights/tp0_….safetensors``) under a directory per bucket position."""
    shutil.rmtree(out, ignore_errors=True)
    paths = []
    for bucket in described["buckets"]:
        for entry in bucket["files"]:
            path = out / str(bucket["position"]) / entry["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            paths.append(str(path))
            subprocess.run(["curl", "-sf", "-o", paths[-1], entry["url"]], check=True)
    subprocess.run(["sha256sum", *paths], check=True, stdout=subprocess.DEVNULL)


def run_measured(command: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Run ``command`` to completion (stdout discarded); its wall seconds and its own peak RSS in bytes (the
    kernel's ``ru_maxrss`` of that one child, from ``wait4``: exact, no sampling). Raises if it fails."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, command)
    return seconds, usage.ru_maxrss * 1024
