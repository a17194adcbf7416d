"""Durable local writes: a file that appears whole in one rename, and a directory entry that survives a
crash (its directory synced). Shared by the local store and the fleet's artifact cache."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Sync a directory: a new entry in it is durable only once its directory is synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """``data`` at ``path``, synced, replacing what was there in one rename (``mode`` less the umask)."""
    temp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)
