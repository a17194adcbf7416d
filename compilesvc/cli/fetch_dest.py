"""Where ``compilesvc fetch`` may write, and how it writes without ever deleting a user's file.

The rules:

* DEST absent: the artifact is staged in DEST's parent, in ``.compilesvc-fetch-<name>-<hash>.partial``,
  and renamed to DEST in one step, so DEST appears complete or not at all.
* DEST an existing empty directory (``.``, a home directory, a mount point, any directory): the files are
  staged inside it (``DEST/.compilesvc-fetch.partial``, on DEST's own file system: the parent may be
  another one, or not writable) and moved in. DEST itself is never renamed or removed, so its inode,
  owner, mode and the shell sitting in it are unaffected.
* DEST holding anything else is refused, unless ``--replace`` is given *and* everything in it was written
  by an earlier fetch: ``manifest.json`` carries the :data:`MARKER` member listing every file that fetch
  wrote (with its size and sha256), and nothing else may be there. The old files are moved aside only after the new
  artifact is downloaded and verified, and only after DEST is checked again.
* Every fetch holds an ``flock`` on a lock file next to its staging directory, so a second fetch of the
  same DEST fails instead of clobbering the first one's staging, and a staging directory found with its
  lock free belongs to a fetch that died: it is removed.

Files are created 0644 and directories 0755, less the umask (``mkdtemp``'s 0700 would hide an artifact
from the serving process that reads it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from compilesvc.spec.manifest import safe_relative

#: The manifest.json member that marks a directory as written by compilesvc fetch.
MARKER = "compilesvc_fetch"
MARKER_FORMAT = 2  # 2: each file's size and sha256
MANIFEST = "manifest.json"
#: Names inside an existing DEST that belong to fetch itself (never the user's).
IN_PLACE_LOCK = ".compilesvc-fetch.lock"
IN_PLACE_STAGING = ".compilesvc-fetch.partial"
IN_PLACE_OLD = ".compilesvc-fetch.old"
OWN_NAMES = frozenset({IN_PLACE_LOCK, IN_PLACE_STAGING, IN_PLACE_OLD})

FILE_MODE = 0o644
DIR_MODE = 0o755


class DestRefused(ValueError):
    """DEST cannot be written as asked; nothing was changed (a command-line problem: exit status 2)."""


class DestBusy(RuntimeError):
    """Another fetch is writing the same DEST right now (exit status 1: try again later)."""


def user_entries(directory: Path) -> list[str]:
    """The names in ``directory`` other than fetch's own lock and staging directories."""
    return sorted(name for name in os.listdir(directory) if name not in OWN_NAMES)


def recorded_files(directory: Path) -> dict[str, tuple[int, str]] | None:
    """The files (relative path -> (size, sha256)) an earlier fetch recorded in ``directory``'s
    manifest.json, or None when there is no manifest.json carrying the marker."""
    path = directory / MANIFEST
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        document = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    marker = document.get(MARKER)
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    files = marker.get("files")
    key = document.get("key")
    if not isinstance(files, dict) or not isinstance(key, str) or marker.get("key") != key:
        return None
    recorded: dict[str, tuple[int, str]] = {}
    for name, entry in files.items():
        try:
            relative = safe_relative(name)
        except ValueError:
            return None
        size, sha256 = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or not isinstance(sha256, str) or relative.name == "" or \
                str(relative) == MANIFEST or relative.parts[0] in OWN_NAMES:
            return None
        recorded[str(relative)] = (size, sha256)
    return recorded


def _sha256_of(path: str) -> str:
    with open(path, "rb") as source:
        return hashlib.file_digest(source, "sha256").hexdigest()


def stranger(directory: Path) -> str | None:
    """Why ``directory`` does not hold only what an earlier fetch wrote (None when it does).

    Every file must be a regular file the marker lists, with the listed size and sha256 (a user's edit of a
    fetched file makes it the user's); every directory must lead to one. Listed files may be missing (an
    interrupted replace), never added to.
    """
    recorded = recorded_files(directory)
    if recorded is None:
        return f"it has no {MANIFEST} written by compilesvc fetch"
    parents = {str(parent) for name in recorded for parent in PurePosixPath(name).parents if str(parent) != "."}
    for root, dirnames, filenames in os.walk(directory):
        base = Path(root).relative_to(directory)
        at_top = base == Path(".")
        for name in sorted(dirnames):
            relative = (base / name).as_posix()
            if at_top and name in OWN_NAMES:
                dirnames.remove(name)
            elif relative not in parents or os.path.islink(os.path.join(root, name)):
                return f"{relative}/ was not written by compilesvc fetch"
        for name in sorted(filenames):
            relative = (base / name).as_posix()
            if at_top and (name in OWN_NAMES or name == MANIFEST):
                continue
            info = os.lstat(os.path.join(root, name))
            if relative not in recorded or not stat.S_ISREG(info.st_mode):
                return f"{relative} was not written by compilesvc fetch"
            size, sha256 = recorded[relative]
            if info.st_size != size or _sha256_of(os.path.join(root, name)) != sha256:
                return f"{relative} changed since compilesvc fetch wrote it"
    return None


def check(dest: Path, replace: bool) -> bool:
    """Whether DEST exists and holds files of an earlier fetch to replace; :class:`DestRefused` when DEST
    may not be written at all. Reads only: a refusal leaves no trace."""
    if os.path.lexists(dest) and not dest.exists():
        raise DestRefused(f"{dest} is a symbolic link to nothing")
    if not dest.exists():
        return False
    if not dest.is_dir():
        raise DestRefused(f"{dest} exists and is not a directory")
    try:
        names = user_entries(dest)
    except OSError as exc:
        raise DestRefused(f"cannot list {dest}: {exc.strerror}") from None
    if not names:
        return False
    if not replace:
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        raise DestRefused(f"{dest} is not empty ({shown}); fetch into a new or empty directory, or pass "
                          "--replace to replace an earlier fetch there")
    why = stranger(dest)
    if why is not None:
        raise DestRefused(f"--replace refused: {why} in {dest}; nothing was changed")
    return True


def _remove_tree(path: Path) -> None:
    """Remove one of fetch's own staging paths (a planted symlink is unlinked, never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


@contextlib.contextmanager
def _locked(lock_path: Path, dest: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path``; :class:`DestBusy` if another fetch holds it."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise DestBusy(f"another compilesvc fetch into {dest} is running"
                           f"{f' (pid {holder})' if holder else ''}; nothing was changed") from None
        # The previous holder unlinks the file as it finishes: a lock on that unlinked file protects nothing.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


def _beside_name(dest: Path) -> str:
    """The deterministic staging name for DEST in its parent (bounded: file names stop at 255 bytes)."""
    digest = hashlib.sha256(os.fsencode(dest.name)).hexdigest()[:8]
    return f".compilesvc-fetch-{dest.name[:64]}-{digest}"


class Staging:
    """A fetch's private directory: files written into it, then installed into DEST by :meth:`install`."""

    def __init__(self, dest: Path, replace_existing: bool):
        self.dest = dest
        self.in_place = dest.exists()
        self.replace_existing = replace_existing
        if self.in_place:
            self.lock_path = dest / IN_PLACE_LOCK
            self.path = dest / IN_PLACE_STAGING
        else:
            name = _beside_name(dest)
            self.lock_path = dest.parent / f"{name}.lock"
            self.path = dest.parent / f"{name}.partial"
        self.written: dict[str, dict[str, int | str]] = {}

    def open_file(self, relative: PurePosixPath) -> BinaryIO:
        """A new file at ``relative`` in the staging directory (0644 less the umask)."""
        directory = self.path
        for part in relative.parts[:-1]:
            directory = directory / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, DIR_MODE)
        fd = os.open(directory / relative.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        return os.fdopen(fd, "wb")

    def write_manifest(self, manifest: dict[str, Any], key: str) -> None:
        """manifest.json with the marker that lets a later ``--replace`` recognise these files."""
        document = {**manifest, MARKER: {"format": MARKER_FORMAT, "key": key,
                                         "files": dict(sorted(self.written.items()))}}
        with self.open_file(PurePosixPath(MANIFEST)) as out:
            out.write(json.dumps(document, indent=1, sort_keys=True).encode())
            out.flush()
            os.fsync(out.fileno())

    def install(self) -> None:
        """Make the staged files DEST's content (see the module docstring for the order and why)."""
        if not self.in_place:
            if os.path.lexists(self.dest):
                raise DestRefused(f"{self.dest} appeared while fetching; nothing was changed")
            os.rename(self.path, self.dest)
            return
        # The user may have added files while we downloaded: check again, just before anything moves.
        current = user_entries(self.dest)
        if current and not self.replace_existing:
            raise DestRefused(f"{self.dest} is no longer empty ({', '.join(current[:3])}); nothing was changed")
        if current:
            why = stranger(self.dest)
            if why is not None:
                raise DestRefused(f"--replace refused: {why} in {self.dest}; nothing was changed")
        old_data = [name for name in current if name != MANIFEST]
        if old_data:
            old = self.dest / IN_PLACE_OLD
            os.mkdir(old, DIR_MODE)
            for name in old_data:
                os.rename(self.dest / name, old / name)
        # manifest.json first: at every moment the manifest in DEST lists all the files DEST holds, so an
        # interrupted install is still recognised by the next --replace.
        os.replace(self.path / MANIFEST, self.dest / MANIFEST)
        for name in sorted(os.listdir(self.path)):
            os.rename(self.path / name, self.dest / name)
        if old_data:
            shutil.rmtree(self.dest / IN_PLACE_OLD)
        os.rmdir(self.path)


@contextlib.contextmanager
def staging_for(dest: Path, replace_existing: bool) -> Iterator[Staging]:
    """Lock DEST for this fetch, clear what a dead fetch left, and yield a fresh staging directory.

    The staging directory is removed on the way out whatever happens (its files were installed, or are
    partial); the lock is released.
    """
    staging = Staging(dest, replace_existing)
    if staging.in_place:
        clean_beside(dest)  # a fetch that died before DEST existed staged beside it
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(staging.lock_path, dest):
        # The lock is ours, so whatever is at these names was left by a fetch that died.
        _remove_tree(staging.path)
        if staging.in_place:
            _remove_tree(dest / IN_PLACE_OLD)
        os.mkdir(staging.path, DIR_MODE)
        try:
            yield staging
        finally:
            _remove_tree(staging.path)


def clean_beside(dest: Path) -> None:
    """Remove the staging directory a dead fetch of DEST left in DEST's parent, if its lock is free."""
    name = _beside_name(dest)
    partial = dest.parent / f"{name}.partial"
    if not os.path.lexists(partial):
        return
    try:
        with _locked(dest.parent / f"{name}.lock", dest):
            _remove_tree(partial)
    except (DestBusy, OSError):
        pass  # a live fetch owns it, or the parent is not ours to write: leave it
