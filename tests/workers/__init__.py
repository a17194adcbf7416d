"""Helpers for the worker tests: run the real compile child (``python -m workers.backends.compile_child``).

The child is started as the runner starts it: a subprocess with its own work dir (all work dirs of a test
share one parent, as on a worker) and a request file. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "compilesvc" / "demo" / "tiny-model.pt2"
PYTHON = sys.executable


def text_inputs(batch: int, seq: int) -> list[dict[str, Any]]:
    """The {batch_size, seq_len} bucket shorthand, expanded."""
    return [{"name": "input_ids", "shape": [batch, seq], "dtype": "int64"},
            {"name": "attention_mask", "shape": [batch, seq], "dtype": "int64"}]


@dataclass
class ChildRun:
    returncode: int
    stdout: str
    stderr: str
    result: dict[str, Any] | None
    out_dir: Path
    work_dir: Path
    seconds: float

    @property
    def lines(self) -> list[str]:
        return (self.stdout + self.stderr).splitlines()

    def describe(self) -> str:
        return (f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}\n"
                f"--- result\n{self.result}")


def make_request(root: Path, name: str, **fields: Any) -> tuple[Path, dict[str, Any]]:
    """Write a request for a run called ``name`` under ``root``/runs; defaults: cpu torchscript."""
    work_dir = root / "runs" / name
    out_dir = root / "out" / name
    work_dir.mkdir(parents=True, exist_ok=True)
    request: dict[str, Any] = {
        "backend": "torchscript",
        "target": "cpu",
        "sdk": "2.13.0",
        "model_path": str(DEMO_MODEL),
        "model_format": "exported-program",
        "inputs": text_inputs(2, 16),
        "args": [],
        "tp_degree": 1,
        "isa": None,
        "out_dir": str(out_dir),
        "work_dir": str(work_dir),
    }
    request.update(fields)
    path = work_dir.parent / f"{name}.request.json"
    path.write_text(json.dumps(request))
    return path, request


def run_child(root: Path, name: str, *, env: Mapping[str, str] | None = None, timeout: float = 300,
              **fields: Any) -> ChildRun:
    """Run one compile child to completion and collect its output and result.json."""
    path, request = make_request(root, name, **fields)
    work_dir = Path(request["work_dir"])
    started = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "workers.backends.compile_child", str(path)], cwd=work_dir,
                          capture_output=True,
                          text=True, timeout=timeout, env=dict(env) if env is not None else None)
    seconds = time.monotonic() - started
    result_path = work_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return ChildRun(proc.returncode, proc.stdout, proc.stderr, result, Path(request["out_dir"]), work_dir, seconds)


def run_children(root: Path, runs: Sequence[tuple[str, dict[str, Any]]],
                 env: Mapping[str, str] | None = None) -> list[ChildRun]:
    """Several children at once (each its own process, as on a worker with several slots)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(runs), os.cpu_count() or 2))) as pool:
        futures = [pool.submit(run_child, root, name, env=env, **fields) for name, fields in runs]
        return [f.result() for f in futures]
