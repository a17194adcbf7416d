"""Starting an attempt's compile child: where it reads and writes (the worker's own directories, or the pod's
spool), the child itself (in the worker's sandbox, or handed to the pod's compile runner), and reading back
the result it left.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compilesvc.compiles import leases
from compilesvc.config.settings import Settings
from workers.compiling.logstream import LogStream
from workers.compiling.workdirs import INDUCTOR_CACHE_NAME
from workers.isolation.child_env import child_environment
from workers.isolation.compiler_process import CompilerProcess
from workers.isolation.sandbox import Mounts, Policy, sandbox_for
from workers.isolation.spool_process import SpoolAttempt, SpoolProcess, spool_attempt

RESULT_NAME = "result.json"
#: More than any real result.json (a list of output files): the child wrote it, so its size is bounded.
RESULT_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class AttemptDirs:
    """Where a compile reads its model and request and writes its work and outputs: the worker's own job
    and work dirs, or (``COMPILESVC_SANDBOX=pod``) an attempt in the spool shared with the compile runner."""

    model: Path
    out: Path
    work: Path
    request: Path
    spooled: SpoolAttempt | None = None

    def staged(self, path: Path) -> Path:
        """Where the worker writes ``path`` before the compile starts."""
        return self.spooled.staged(path) if self.spooled is not None and path.is_relative_to(self.spooled.dir) \
            else path


@contextmanager
def compile_dirs(settings: Settings, bucket_id: int, files: Path, work_dir: Path) -> Iterator[AttemptDirs]:
    """The attempt's directories: beside its job dir ``files``, or an attempt in the pod's spool (wiped after)."""
    if settings.sandbox != "pod":
        for directory in (files / "model", files / "out"):
            directory.mkdir()
        yield AttemptDirs(files / "model", files / "out", work_dir, files / "request.json")
        return
    assert settings.compile_spool is not None  # checked at worker start
    with spool_attempt(settings.compile_spool, bucket_id) as spooled:
        yield AttemptDirs(spooled.model_dir, spooled.out, spooled.work, spooled.request, spooled)


def start_child(settings: Settings, claim: leases.Claim, dirs: AttemptDirs, tmp: Path, logs: LogStream,
                policy: Policy) -> CompilerProcess | SpoolProcess:
    """The compile child of this attempt, started in the worker's sandbox, or handed to the pod's runner."""
    if dirs.spooled is not None:
        return SpoolProcess(dirs.spooled, logs=logs, limits=policy.limits, timeout=settings.compile_timeout_seconds,
                            target=claim.target, max_log_bytes=settings.sandbox_max_log_mb * 1024 * 1024,
                            pickup_seconds=settings.compile_runner_pickup_seconds,
                            stale_seconds=settings.compile_runner_stale_seconds)
    # The child sees its model and request read-only, writes only its work and output directories, and
    # gets a private inductor cache at the path the cpu backend uses (that path is in what it generates).
    private = tmp / "inductor-cache", tmp / "tmp"
    for directory in private:
        directory.mkdir()
    mounts = Mounts(read_only=[dirs.model, dirs.request], writable=[dirs.work, dirs.out],
                    private={dirs.work.parent / INDUCTOR_CACHE_NAME: private[0]})
    env = child_environment(os.environ, claim.target)
    sandbox = sandbox_for(policy, mounts, env)
    if sandbox is None:
        # torch keeps caches under TMPDIR (/tmp/torchinductor_<user>) that every compile would otherwise
        # share: a compile's temporary files are its own (the sandbox gives it a private /tmp).
        env["TMPDIR"] = str(private[1])
    return CompilerProcess([sys.executable, "-m", "workers.backends.compile_child", str(dirs.request)],
                           cwd=dirs.work, env=env, logs=logs, sandbox=sandbox)


def read_result(path: Path) -> dict[str, Any] | None:
    """The child's result.json: a regular file it wrote, never what a link it planted points at."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            document = json.loads(fh.read(RESULT_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None
