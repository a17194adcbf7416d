"""The local artifact cache: a directory many processes read without locks, and writers fill atomically.

Layout (``<root>/v1/``; a later layout gets its own directory, so an old reader never misreads it)::

    blobs/<2 hex>/<sha256>        file contents by sha256, shared by every artifact holding them (0444)
    artifacts/<key>/              an artifact, present only when complete:
        manifest.json               the canonical artifact manifest (its material derives <key>)
        model.sig                   its signature (compilesvc.signing.artifacts), checked at every open
        bucket-<position>/<path>    hard links to the blobs (copies where the file system has no links)
    specs/<sha256 of a spec>      the key a spec resolved to, so ``--spec`` works offline
    partial/<sha256>.part         downloads in progress or interrupted: the next writer resumes them
    locks/<sha256>.lock           writers' flocks, one per blob (readers never take or need them)
    staging/                      artifact directories being assembled, renamed into artifacts/ whole

Readers (:meth:`ArtifactCache.read`) open files and nothing else, so a cache on a read-only volume, a
baked AMI or a shared mount serves them; they verify what they read (the manifest against the key, each
file against the manifest), because a byte flipped on disk must fail at boot, not at the first request.
Writers hold a blob's flock while downloading it, so processes that start together download each file
once; an artifact directory appears in one ``rename`` after every file in it is verified, and the
manifest is written last inside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath

from compilesvc.durable import fsync_dir, write_atomically
from compilesvc.signing.artifacts import SIGNATURE_FILE
from compilesvc.spec.manifest import (
    ArtifactManifest,
    FileEntry,
    ManifestMismatch,
    parse_artifact_manifest,
    safe_relative,
)

LAYOUT = "v1"
MANIFEST = "manifest.json"
SIGNATURE = SIGNATURE_FILE
BLOB_MODE = 0o444
DIR_MODE = 0o777  # less the umask: a shared cache wants group-writable directories (umask 002)
#: Staging directories older than this belong to a writer that died; the next writer removes them.
STALE_STAGING_SECONDS = 3600
_READ_CHUNK = 1024 * 1024


class Verify(StrEnum):
    """How much of a cached file is checked before it is handed out."""

    SHA256 = "sha256"  # every byte hashed: catches a flipped bit (the default)
    SIZE = "size"  # sizes only: for multi-GiB sets whose volume is trusted, at the cost of that check


class CacheError(Exception):
    """The cache cannot serve or store the artifact; the message says which file and why."""


class FilesDiffer(CacheError):
    """Cached files are missing or differ from the signed manifest and cannot be fetched again here."""


@dataclass(frozen=True)
class Placed:
    """A file of an artifact as the cache lays it out: ``relative`` inside the artifact directory."""

    relative: PurePosixPath
    entry: FileEntry


def default_cache_dir() -> Path:
    """``$COMPILESVC_CACHE_DIR``, else ``$XDG_CACHE_HOME/compilesvc``, else ``~/.cache/compilesvc``."""
    explicit = os.environ.get("COMPILESVC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "compilesvc"


def placed_files(manifest: ArtifactManifest, *, with_logs: bool = False) -> list[Placed]:
    """Every file of ``manifest`` at its place in the artifact directory (``bucket-<position>/<path>``)."""
    out = []
    for bucket in manifest.buckets:
        entries = [*bucket.files, *([bucket.log] if with_logs and bucket.log is not None else [])]
        for entry in entries:
            out.append(Placed(safe_relative(bucket.placed(entry)), entry))
    return out


def file_matches(path: Path, entry: FileEntry, verify: Verify) -> bool:
    """``path`` holds exactly ``entry`` (its size; with :attr:`Verify.SHA256` also its sha256)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != entry.size:
                return False
            if verify == Verify.SIZE:
                return True
            digest = hashlib.sha256()
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
            return digest.hexdigest() == entry.sha256
    except OSError:
        return False


class ArtifactCache:
    """One cache directory (see the module docstring). Cheap to create; holds no open files."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.base = self.root / LAYOUT
        self.blob_mode = BLOB_MODE & ~current_umask()

    # -- reading (no writes, no locks) --------------------------------------------------------------------

    def artifact_dir(self, key: str) -> Path:
        return self.base / "artifacts" / key

    def blob_path(self, sha256: str) -> Path:
        return self.base / "blobs" / sha256[:2] / sha256

    def read(self, key: str) -> ArtifactManifest | None:
        """The cached manifest of ``key`` (None: not cached). A manifest that does not derive ``key`` is
        a corrupt cache entry: :class:`CacheError`."""
        try:
            data = (self.artifact_dir(key) / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read {self.artifact_dir(key) / MANIFEST}: {exc.strerror}") from None
        try:
            return parse_artifact_manifest(data, key)
        except ManifestMismatch:
            raise CacheError(f"{self.artifact_dir(key) / MANIFEST} is corrupt: it does not derive key {key}; "
                             "remove the directory (or let a writable cache refetch it)") from None

    def read_signature(self, key: str) -> bytes | None:
        """The signature kept beside ``key``'s manifest (None: an entry cached before signatures)."""
        try:
            return (self.artifact_dir(key) / SIGNATURE).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"cannot read {self.artifact_dir(key) / SIGNATURE}: {exc.strerror}") from None

    def write_signature(self, key: str, bundle: bytes) -> None:
        """Keep a verified signature beside an entry cached before signatures were, for offline opens."""
        write_atomically(self.artifact_dir(key) / SIGNATURE, bundle, 0o644)

    def damaged(self, key: str, placed: Iterable[Placed], verify: Verify) -> list[Placed]:
        """The files of ``key``'s directory that are missing or do not match their manifest entries."""
        directory = self.artifact_dir(key)
        return [p for p in placed if not file_matches(directory / p.relative, p.entry, verify)]

    def key_for_spec(self, spec_digest: str) -> str | None:
        """The key a spec with this digest resolved to when it was last fetched online."""
        try:
            key = (self.base / "specs" / spec_digest).read_text().strip()
        except OSError:
            return None
        return key if len(key) == 64 and all(c in "0123456789abcdef" for c in key) else None

    def writable(self) -> bool:
        """Whether this process may fill the cache (creating it if it does not exist yet)."""
        probe = self.root
        while not probe.exists():
            if probe.parent == probe:
                return False
            probe = probe.parent
        return os.access(self.base if self.base.exists() else probe, os.W_OK | os.X_OK)

    # -- writing ------------------------------------------------------------------------------------------

    def _dir(self, *parts: str) -> Path:
        path = self.base.joinpath(*parts)
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        return path

    def remember_spec(self, spec_digest: str, key: str) -> None:
        write_atomically(self._dir("specs") / spec_digest, key.encode() + b"\n", 0o644)

    @contextlib.contextmanager
    def blob_lock(self, sha256: str, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Exclusive among writers of this blob (any process, any host sharing a POSIX-locking volume);
        ``on_wait`` is called first if another writer holds it."""
        fd = os.open(self._dir("locks") / f"{sha256}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock; the lock file stays (unlinking it would race other writers)

    def partial_path(self, sha256: str) -> Path:
        return self._dir("partial") / f"{sha256}.part"

    def install_blob(self, partial: Path, sha256: str) -> Path:
        """Move a verified download into the blob store (read-only, one rename). Call under the blob lock."""
        os.chmod(partial, self.blob_mode)
        target = self.blob_path(sha256)
        target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.replace(partial, target)
        return target

    def publish(self, manifest: ArtifactManifest, placed: list[Placed], signature: bytes) -> Path:
        """Assemble ``manifest``'s directory from verified blobs and rename it into place; if another
        writer got there first, theirs stays (the content is the same by construction)."""
        self._clear_stale_staging()
        staging = self._dir("staging") / f"{manifest.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(mode=DIR_MODE)
        target = self.artifact_dir(manifest.key)
        try:
            for p in placed:
                self._place(p, staging)
            write_atomically(staging / SIGNATURE, signature, 0o644)
            write_atomically(staging / MANIFEST, manifest.to_bytes(), 0o644)  # last: its presence means whole
            target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            try:
                os.rename(staging, target)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            else:
                fsync_dir(target.parent)
                return target
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return target

    def repair(self, key: str, placed: Iterable[Placed]) -> None:
        """Put fresh links to the (re-downloaded) blobs at ``placed`` in ``key``'s existing directory."""
        directory = self.artifact_dir(key)
        for p in placed:
            self._place(p, directory)

    def _place(self, placed: Placed, directory: Path) -> None:
        """A link to the blob at ``directory/placed.relative`` (replacing what is there in one rename)."""
        target = directory / placed.relative
        target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        temp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
        blob = self.blob_path(placed.entry.sha256)
        try:
            os.link(blob, temp)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(blob, temp)  # a file system without hard links: a copy, same bytes
            os.chmod(temp, self.blob_mode)
        os.replace(temp, target)

    def _clear_stale_staging(self) -> None:
        staging = self.base / "staging"
        if not staging.is_dir():
            return
        cutoff = time.time() - STALE_STAGING_SECONDS
        for entry in staging.iterdir():
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry, ignore_errors=True)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells (setting and restoring it would race
    the threads that download in parallel)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
