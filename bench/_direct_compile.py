"""The compile bench.pipeline's part a. measures, done directly: what a user runs without the service.

``python -m bench._direct_compile MODEL_PT2 BATCH SEQ OUT_DIR`` loads the ``torch.export`` program, exports
it at the bucket's static shapes, compiles it with ``torch._inductor.aoti_compile_and_package`` into
``OUT_DIR/model.pt2``, loads the package back and runs it once (the check the service's cpu backend also
makes before it reports an artifact). Plain torch only, nothing of compilesvc: the baseline must not share
the service's code. :func:`time_direct` runs it in a fresh process, timed from the outside, so the torch
import counts as it does in the service's compile child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def time_direct(model: Path, batch: int, seq: int, env: dict[str, str] | None = None) -> float:
    """Wall seconds of one direct compile in a fresh interpreter (its own empty inductor cache)."""
    with tempfile.TemporaryDirectory(prefix="direct-compile-") as scratch:
        child_env = {**os.environ, **(env or {}), "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor"}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "bench._direct_compile", str(model), str(batch), str(seq),
                               scratch], cwd=ROOT, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, check=False)
        seconds = time.monotonic() - started
        if done.returncode != 0:  # torch's warnings are noise unless it failed
            raise RuntimeError(f"the direct compile exited {done.returncode}:\n{done.stderr[-3000:]}")
        return seconds


def _compile(model_path: str, batch: int, seq: int, out_dir: str) -> None:
    import torch

    module = torch.export.load(model_path).module()
    inputs = (torch.randint(0, 100, (batch, seq), dtype=torch.int64), torch.ones((batch, seq), dtype=torch.int64))
    exported = torch.export.export(module, inputs, strict=False)
    package = str(Path(out_dir) / "model.pt2")
    torch._inductor.aoti_compile_and_package(exported, package_path=package)
    torch._inductor.aoti_load_package(package)(*inputs)


if __name__ == "__main__":
    _compile(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
