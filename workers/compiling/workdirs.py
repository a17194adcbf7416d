"""Work directories of compile attempts on a worker host: one pair per attempt, removed afterwards, and a
sweep for those of workers that died (each may hold a copy of a large model)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def work_root() -> Path:
    """Where attempts keep their files: one fixed directory per host and user.

    Fixed because AOTInductor embeds its cache directory's path in what it generates, and the cpu backend
    keeps that cache next to the work dirs (``<root>/compilesvc-inductor-cache``): a per-attempt parent
    would make every compile's bytes different. Per user so two services on a host never share it.
    """
    root = Path(tempfile.gettempdir()) / f"compilesvc-work-{os.getuid()}"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


OWNER_LOCK = ".owner"
#: Directory name, next to the attempts' work dirs, of the inductor cache AOTInductor uses
#: (:func:`workers.backends.cpu.inductor_cache`). A sandboxed compile sees a private one at that path.
INDUCTOR_CACHE_NAME = "compilesvc-inductor-cache"
#: Work dirs without a job dir are only swept when older than this (one may be a second old, being set up).
UNPAIRED_WORK_DIR_SECONDS = 3600


@contextmanager
def attempt_dirs(bucket_id: int) -> Iterator[tuple[Path, Path]]:
    """``(files, work_dir)``: two fresh sibling directories under :func:`work_root`, removed afterwards.

    ``files`` (``job-<suffix>``) holds the model, the request, the outputs and the log; ``work_dir``
    (``work-<suffix>``) is the child's scratch and cwd, randomly named directly under the fixed root. The
    attempt holds an exclusive ``flock`` on ``files/.owner`` while it runs: the kernel drops it when the
    worker dies, however it dies, which is how :func:`sweep_orphaned_attempts` tells leftovers from live
    attempts. The job dir gets its final name only once locked, so no sweep ever sees it unlocked.
    """
    root = work_root()
    work = Path(tempfile.mkdtemp(prefix=f"work-{bucket_id}-", dir=root))
    files = root / ("job-" + work.name.removeprefix("work-"))
    staging = Path(tempfile.mkdtemp(prefix=".new-", dir=root))
    owner = open(staging / OWNER_LOCK, "w")  # noqa: SIM115 - held for the whole attempt
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        staging.rename(files)
        yield files, work
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        owner.close()


def sweep_orphaned_attempts(root: Path | None = None) -> list[str]:
    """Remove the directories of attempts whose worker died without cleaning up (SIGKILL, OOM, power);
    they can hold a copy of a large model each. Safe while other workers on the host are running: a live
    attempt holds its owner lock. Returns the names removed."""
    root = root or work_root()
    removed = []
    cutoff = time.time() - UNPAIRED_WORK_DIR_SECONDS
    for files in sorted(root.glob("job-*")):
        try:
            lock = open(files / OWNER_LOCK)  # noqa: SIM115 - closed below
        except OSError:  # being removed by its own attempt right now, or left half-removed long ago
            with contextlib.suppress(OSError):
                if files.stat().st_mtime < cutoff:
                    shutil.rmtree(files, ignore_errors=True)
                    removed.append(files.name)
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live attempt
            shutil.rmtree(root / ("work-" + files.name.removeprefix("job-")), ignore_errors=True)
            shutil.rmtree(files, ignore_errors=True)
            removed.append(files.name)
    for pattern in ("work-*", ".new-*"):
        for path in root.glob(pattern):
            twin = root / ("job-" + path.name.removeprefix("work-"))
            with contextlib.suppress(OSError):
                if (pattern != "work-*" or not twin.exists()) and path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path.name)
    return removed
