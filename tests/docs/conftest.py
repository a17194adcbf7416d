"""The stack the docs' blocks run against: the worker tests' cluster (a worker, the relay and the API on the
test's Postgres ledger and Redis broker), and :class:`Shell`, which runs a block as a user's shell would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.workers.conftest import Cluster, broker_prefix, make_cluster, tiny_torch_model  # noqa: F401 (fixtures)

MakeCluster = Callable[..., Cluster]
BIN = str(Path(sys.executable).parent)


@dataclass
class Shell:
    """Runs blocks with bash (``-e``: the first failing command fails the block) in ``cwd``, with the
    compilesvc of this checkout first on PATH."""

    env: dict[str, str]
    cwd: Path

    def __post_init__(self) -> None:
        self.env = {**self.env, "PATH": f"{BIN}{os.pathsep}{self.env.get('PATH', os.environ.get('PATH', ''))}"}

    def run(self, script: str, check: bool = True, timeout: float = 300,
            **extra: str) -> subprocess.CompletedProcess[str]:
        run = subprocess.run(["bash", "--noprofile", "--norc", "-e", "-c", script], env={**self.env, **extra},
                             cwd=self.cwd, capture_output=True, text=True, timeout=timeout)
        if check:
            assert run.returncode == 0, f"{script}\n-> {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run
