"""The spool: how a worker in ``COMPILESVC_SANDBOX=pod`` mode and the compile runner of its pod
(:mod:`workers.isolation.compile_runner`) hand a compile attempt to each other through a shared directory.

The two share nothing else (no socket, no process), so every message is a file, and every file the
compile container could have touched is read as hostile: without following links (``O_NOFOLLOW``), only
if it is a regular file, bounded in size. Layout under the spool directory::

    runner/heartbeat              the runner's clock, rewritten every second (the worker tells it is alive)
    models/<attempt>/model.*      the attempt's model (the compile container mounts models/ read-only)
    attempts/.new-<attempt>/      being laid out by the worker: the runner ignores dot-names
    attempts/<attempt>/           handed over (renamed once complete):
        control.json              the worker's: what to run, the limits, the time limit
        request.json              the compile child's request
        work/ out/ tmp/           the child's cwd and scratch, its outputs, its TMPDIR
        run/claimed               the runner's: it took the attempt
        run/compile.log           the child's output, as it is printed
        run/status.json           the runner's, atomically, after the child and all it started are dead
        cancel                    the worker's: stop the compile now

A compile runs as the runner's uid and can rewrite anything under its own ``attempts/<attempt>/``
(``status.json`` included) and the heartbeat: that only changes the outcome of its own attempt, whose
outputs it controls anyway (docs/security.md). It cannot change its model (a read-only mount) or reach
the worker's files and settings (another container).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

ATTEMPTS, MODELS, RUNNER = "attempts", "models", "runner"
HEARTBEAT = "heartbeat"
CONTROL, REQUEST, CANCEL = "control.json", "request.json", "cancel"
RUN, CLAIMED, LOG, STATUS = "run", "claimed", "compile.log", "status.json"
#: The directories of an attempt the child writes (created by the worker, in this order).
CHILD_DIRS = ("work", "out", "tmp")
STAGING_PREFIX = ".new-"
#: More than any control, status or result document: whatever wrote them, reads stay bounded.
DOCUMENT_MAX_BYTES = 16 * 1024 * 1024


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` if it is a regular file reached without following a link at its last
    component; OSError otherwise (the descriptor is closed)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def read_document(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, not a regular file, or not an object."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            document = json.loads(fh.read(DOCUMENT_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write ``path`` atomically (a reader sees all of it or nothing) without following a link planted at
    either name: the temporary name is created exclusively, and rename replaces a link, not its target."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(document, sort_keys=True))
    os.replace(tmp, path)


def beat(spool: Path) -> None:
    write_document(spool / RUNNER / HEARTBEAT, {"at": time.time(), "pid": os.getpid()})


def heartbeat_age(spool: Path) -> float | None:
    """Seconds since the runner last wrote its heartbeat (None: it never did)."""
    try:
        return max(0.0, time.time() - os.lstat(spool / RUNNER / HEARTBEAT).st_mtime)
    except OSError:
        return None


def wipe(path: Path) -> None:
    """Remove ``path`` and everything under it, whatever modes the compile gave its directories, following
    no link (a link is removed, never what it names)."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        os.unlink(path)
        return
    # A compile may leave directories without search or write permission: give them back first, walking
    # only real directories (os.walk does not follow links unless asked).
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(os.path.join(root, name)).st_mode):
                    os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: safe against links swapped in meanwhile


def copy_regular(src_dir: Path, relative: str, dest_dir: Path) -> Path:
    """Copy ``src_dir/relative`` to ``dest_dir/relative``, opening every component without following links
    and only a regular file at the end; OSError when the path holds a link, leaves ``src_dir`` or is not a
    regular file. What the worker publishes is this copy, so a link the compile left is never followed and
    the file cannot change between hashing and upload."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise OSError(f"output path {relative!r} is not inside the output directory")
    dir_fd = os.open(src_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    dest = dest_dir.joinpath(*parts)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise OSError(f"output {relative!r} is not a regular file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return dest


def copy_outputs(out_dir: Path, result: dict[str, Any], dest: Path) -> Path:
    """The files a compile's ``result`` names, copied from ``out_dir`` into ``dest`` (:func:`copy_regular`)."""
    dest.mkdir()
    for item in result.get("files") or []:
        if isinstance(item, dict):
            copy_regular(out_dir, str(item.get("path")), dest)
    return dest
