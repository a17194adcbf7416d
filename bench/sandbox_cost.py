"""What the compile sandbox costs: its start, and a whole cpu compile inside it against the same compile without.

``python -m bench.sandbox_cost [--starts N] [--rounds N] [--backend torchscript|aotinductor]``

- **start**: the median wall time of starting the sandbox and running ``/bin/true`` in it (bubblewrap's
  namespaces and mounts, the user switch), as :class:`workers.isolation.compiler_process.CompilerProcess` starts a
  compile child. Target: <= 0.2 s (issue 25).
- **compile**: the compile child (``python -m workers.backends.compile_child``) on the bundled demo model at its
  largest bucket, in the sandbox and without it, interleaved round by round (this host is noisy), each run
  with a fresh attempt directory; the ratio of the medians. Target: <= 1.03x. The run without the sandbox
  gets a fresh ``TMPDIR`` too, as the runner gives it: torch keeps an inductor cache under it
  (``/tmp/torchinductor_<user>``) that a compile with the host's ``TMPDIR`` shares with every compile
  before it. ``--shared-tmp`` measures against that shared, warm cache instead: the price of not sharing
  it, which is isolation, not overhead.

Runs the worker's own code paths with the worker's settings (``COMPILESVC_SANDBOX_*``), nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from bench import _table
from compilesvc.config.settings import Settings
from compilesvc.demo import MODEL_FILE, demo_model_bytes, demo_spec
from workers.isolation.child_env import child_environment
from workers.isolation.compiler_process import CompilerProcess
from workers.isolation.sandbox import Mounts, Policy, Sandbox

BENCH = "sandbox_cost"


class _Discard:
    def pump(self, stream: IO[bytes]) -> None:
        while stream.read(1 << 16):
            pass


def _run(argv: list[str], cwd: Path, sandbox: Sandbox | None, env: dict[str, str]) -> float:
    started = time.monotonic()
    child = CompilerProcess(argv, cwd=cwd, env=env, logs=_Discard(), sandbox=sandbox)
    returncode, _ = child.wait(3600, threading.Event(), grace=5)
    seconds = time.monotonic() - started
    if returncode != 0:
        raise SystemExit(f"{argv[:3]} exited {returncode} ({'sandboxed' if sandbox else 'plain'})")
    return seconds


def starts(policy: Policy, count: int, root: Path) -> list[float]:
    env = child_environment(os.environ)
    scratch = root / "start"
    scratch.mkdir()
    return [_run(["/bin/true"], scratch, Sandbox(policy, Mounts(writable=[scratch]), env), env)
            for _ in range(count)]


def one_compile(policy: Policy | None, backend: str, root: Path, shared_tmp: bool = False) -> float:
    """One compile of the demo model's largest bucket in a fresh attempt directory, laid out as the runner
    lays it (workers.compiling.runner)."""
    job = Path(tempfile.mkdtemp(prefix="job-", dir=root))
    work = Path(tempfile.mkdtemp(prefix="work-", dir=root))
    model_dir, out_dir, cache = job / "model", job / "out", job / "inductor-cache"
    for directory in (model_dir, out_dir, cache):
        directory.mkdir()
    (model_dir / MODEL_FILE).write_bytes(demo_model_bytes())
    spec = demo_spec()
    bucket = spec["buckets"][-1]
    inputs = [{"name": "input_ids", "shape": [bucket["batch_size"], bucket["seq_len"]], "dtype": "int64"},
              {"name": "attention_mask", "shape": [bucket["batch_size"], bucket["seq_len"]], "dtype": "int64"}]
    request = {"backend": backend, "target": "cpu", "sdk": spec["sdk"], "model_path": str(model_dir / MODEL_FILE),
               "model_format": spec["model"]["format"], "inputs": inputs,
               "args": spec["compiler"]["args"] if backend == "torchscript" else [], "tp_degree": 1, "isa": None,
               "out_dir": str(out_dir), "work_dir": str(work)}
    request_path = job / "request.json"
    request_path.write_text(json.dumps(request))
    env = child_environment(os.environ, "cpu")
    if policy is None and not shared_tmp:  # as hermetic as the sandbox's private /tmp (the module docstring)
        env["TMPDIR"] = tempfile.mkdtemp(prefix="tmp-", dir=root)
    mounts = Mounts(read_only=[model_dir, request_path], writable=[work, out_dir],
                    private={work.parent / "compilesvc-inductor-cache": cache})
    sandbox = Sandbox(policy, mounts, env) if policy is not None else None
    return _run([sys.executable, "-m", "workers.backends.compile_child", str(request_path)], work, sandbox, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=30, help="sandbox starts to time")
    parser.add_argument("--rounds", type=int, default=5, help="compile pairs (sandboxed, plain), interleaved")
    parser.add_argument("--backend", choices=["torchscript", "aotinductor"], default="torchscript")
    parser.add_argument("--shared-tmp", action="store_true",
                        help="compile without the sandbox in the host's TMPDIR, sharing torch's caches there")
    args = parser.parse_args(argv)
    policy = Policy.from_settings(Settings())
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as scratch:
        root = Path(scratch)
        os.chmod(root, 0o755)
        started = starts(policy, args.starts, root)
        print(f"sandbox start (/bin/true): min {min(started):.3f} s, median {statistics.median(started):.3f} s, "
              f"max {max(started):.3f} s over {len(started)}")
        one_compile(policy, args.backend, root)  # warm the page cache for both sides
        sandboxed, plain = [], []
        for n in range(args.rounds):
            first, second = (sandboxed, plain) if n % 2 == 0 else (plain, sandboxed)
            for side in (first, second):
                side.append(one_compile(policy if side is sandboxed else None, args.backend, root,
                                        args.shared_tmp))
            print(f"round {n + 1}: sandboxed {sandboxed[-1]:.2f} s, plain {plain[-1]:.2f} s", flush=True)
    ratio = statistics.median(sandboxed) / statistics.median(plain)
    _table.record(BENCH, "sandbox start, median", statistics.median(started), "s", at_most=0.2,
                  vs="bubblewrap + user switch + /bin/true")
    against = "the same compile child without it" + (", sharing the host's TMPDIR" if args.shared_tmp else "")
    _table.record(BENCH, f"whole cpu compile ({args.backend}) in the sandbox", ratio, "x",
                  at_most=None if args.shared_tmp else 1.03, vs=f"{against} (medians of {args.rounds}: "
                     f"{statistics.median(sandboxed):.2f} s / {statistics.median(plain):.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
