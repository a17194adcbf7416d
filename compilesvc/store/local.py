"""LocalStore: the artifact store as a directory, for the embedded mode and single-host deployments.

Layout under ``root``: ``blobs/sha256/<aa>/<hex>`` (content-addressed blobs), documents at their names
(``artifacts/<key>/manifest.json`` …) and ``tmp/`` for files being written. Every write goes to a temp
file in ``tmp/`` (same filesystem) and is published with :func:`os.link`, which fails if the target
exists: that is the atomic create-only primitive, so a reader never sees a partial file and nothing is
ever overwritten. A write that ends short of (or differs from) what its caller declared is never
linked. Temp files a killed process left behind are removed by :meth:`LocalStore.sweep_incomplete_uploads`.
Downloads are served by the API through HMAC-signed URLs (:mod:`.signing`).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO

from compilesvc.durable import fsync_dir
from compilesvc.store.base import (
    BLOB_PREFIX,
    SHA256_RE,
    ArtifactStore,
    BlobInfo,
    BlobNotFound,
    StoredBlob,
    StoreError,
    StoreUnavailable,
    blob_name,
    check_expected,
)
from compilesvc.store.hashing import CHUNK_SIZE, SinkWriteError, copy_hashing, verified_file
from compilesvc.store.signing import check_filename, sign_blob_url

#: Age at which a temp file found when a store is opened counts as abandoned (the relay sweeps sooner).
STALE_TEMP_SECONDS = 24 * 3600
TEMP_PREFIX = "w-"



class LocalStore(ArtifactStore):
    """Blobs and documents in a directory; see the module docstring for the layout and guarantees."""

    def __init__(self, root: Path, *, public_url: str, secret_key: bytes):
        if not secret_key:
            raise ValueError("LocalStore needs a non-empty secret_key to sign download URLs")
        self.root = Path(root).resolve()
        self.public_url = public_url.rstrip("/")
        self._secret_key = secret_key
        self.url = self.root.as_uri()
        #: Unix time for the URLs this store signs; a test may set it to sign "in the past" (None: time.time,
        #: looked up at each call).
        self.clock: Callable[[], float] | None = None
        self._tmp = self.root / "tmp"
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            (self.root / "blobs").mkdir(exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot create the local store at {self.root}: {exc}") from exc
        self.sweep_incomplete_uploads(timedelta(seconds=STALE_TEMP_SECONDS))

    def sweep_incomplete_uploads(self, older_than: timedelta) -> int:
        # A temp file's mtime moves with every chunk written, so an upload still arriving (however long
        # it has been running) looks fresh; a process killed mid-write leaves one that only ages.
        # Several processes share tmp/, hence the age test rather than "everything of ours".
        cutoff = time.time() - older_than.total_seconds()
        try:
            entries = list(os.scandir(self._tmp))
        except OSError:
            return 0  # check() reports an unusable tmp/; the sweep is housekeeping only
        removed = 0
        for entry in entries:
            try:
                if (entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_mtime < cutoff):
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                pass  # raced with another sweeper, or not ours to remove: harmless
        return removed

    # -- paths ---------------------------------------------------------------------------------------

    def local_blob_path(self, sha256: str) -> Path:
        """Where a blob's file lives (it may not exist); the API streams downloads from here."""
        return self.root / blob_name(sha256)

    def _document_path(self, name: str) -> Path:
        # Documents are named by our code (manifest names), but a name is still a path: refuse
        # anything that could land outside the root or collide with the blob and tmp areas.
        parts = name.split("/")
        if "\\" in name or any(p in ("", ".", "..") for p in parts) or parts[0] in ("blobs", "tmp"):
            raise ValueError(f"invalid document name {name!r}")
        return self.root.joinpath(*parts)

    @contextmanager
    def _temp_file(self) -> Iterator[tuple[BinaryIO, Path]]:
        """A temp file in ``tmp/``, always unlinked on exit (a published file lives on under its link)."""
        try:
            fd, name = tempfile.mkstemp(dir=self._tmp, prefix=TEMP_PREFIX)
        except OSError as exc:
            raise StoreError(f"cannot create a temp file in {self._tmp}: {exc}") from exc
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle, path
        finally:
            path.unlink(missing_ok=True)

    def _publish(self, temp: Path, target: Path) -> bool:
        """Link ``temp`` into place create-only. True if created, False if ``target`` already existed."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(temp, target)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc}") from exc
        fsync_dir(target.parent)
        return True

    # -- blobs ---------------------------------------------------------------------------------------

    def _put(self, read: Callable[[int], bytes], max_bytes: int | None, *, expected_size: int | None = None,
             expected_sha256: str | None = None) -> BlobInfo:
        # Errors reading the source (a client hanging up, a missing file) propagate unchanged; only
        # failures of the store itself become StoreError, which callers treat as infrastructure.
        with self._temp_file() as (handle, temp):
            try:
                copied = copy_hashing(read, handle.write, max_bytes=max_bytes)
            except SinkWriteError as exc:
                raise StoreError(f"cannot write to the local store: {exc.cause}") from exc.cause
            # Before the link: a refused write leaves only the temp file, which the context removes.
            check_expected(copied.sha256, copied.size, expected_size=expected_size, expected_sha256=expected_sha256)
            try:
                handle.flush()
                os.fsync(handle.fileno())
                # Blobs are immutable: make that visible to anyone poking at the directory.
                os.chmod(temp, 0o444)
            except OSError as exc:
                raise StoreError(f"cannot write to the local store: {exc}") from exc
            created = self._publish(temp, self.local_blob_path(copied.sha256))
        return BlobInfo(copied.sha256, copied.size, created)

    def put_file(self, path: Path) -> BlobInfo:
        # Copy rather than hard-link the source: a later change to the caller's file must never
        # change a stored blob (hard links share the inode).
        with open(path, "rb") as src:
            return self._put(src.read, None)

    def _put_stream(self, stream: BinaryIO, max_bytes: int | None, expected_size: int | None,
                    expected_sha256: str | None) -> BlobInfo:
        return self._put(stream.read, max_bytes, expected_size=expected_size, expected_sha256=expected_sha256)

    def blob_size(self, sha256: str) -> int | None:
        try:
            return self.local_blob_path(sha256).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot stat blob {sha256}: {exc}") from exc

    @contextmanager
    def _open(self, sha256: str) -> Iterator[BinaryIO]:
        try:
            handle = open(self.local_blob_path(sha256), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise BlobNotFound(f"blob {sha256} not found") from None
        except OSError as exc:
            raise StoreError(f"cannot open blob {sha256}: {exc}") from exc
        with handle:
            yield handle

    def open_blob(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        return self._open(sha256)

    def read_blob_range(self, sha256: str, offset: int, length: int) -> bytes:
        with self._open(sha256) as handle:
            try:
                handle.seek(offset)
                return handle.read(length)
            except OSError as exc:
                raise StoreError(f"cannot read blob {sha256}: {exc}") from exc

    def open_blob_ranged(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        return self._open(sha256)  # a file seeks and reads what is read

    def download_blob(self, sha256: str, dest: Path) -> None:
        with verified_file(dest, sha256, what=f"blob {sha256} (the stored file is corrupt)") as out, \
                self._open(sha256) as src:
            shutil.copyfileobj(src, out, CHUNK_SIZE)  # verified_file hashes what passes

    # -- documents -----------------------------------------------------------------------------------

    def create_document(self, name: str, data: bytes) -> bool:
        target = self._document_path(name)
        if target.exists():
            return False
        with self._temp_file() as (handle, temp):
            try:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                raise StoreError(f"cannot write document {name}: {exc}") from exc
            os.chmod(temp, 0o444)
            return self._publish(temp, target)

    def read_document(self, name: str) -> bytes | None:
        try:
            return self._document_path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read document {name}: {exc}") from exc

    def document_location(self, name: str) -> str:
        return self._document_path(name).as_uri()

    # -- URLs and health -----------------------------------------------------------------------------

    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str:
        if expires_in <= 0:
            raise ValueError("expires_in must be positive")
        if filename is not None:
            check_filename(filename)
        # Round up: the URL must stay valid for at least expires_in seconds, not up to a second less.
        expires = math.ceil((self.clock or time.time)()) + expires_in
        sig = sign_blob_url(self._secret_key, sha256, expires, filename)
        query = {"expires": str(expires), "sig": sig}
        if filename is not None:
            query["filename"] = filename
        encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        return f"{self.public_url}/v1/blobs/{sha256}?{encoded}"

    def iter_blobs(self) -> Iterator[StoredBlob]:
        base = self.root / BLOB_PREFIX
        for directory in sorted(base.glob("??")) if base.is_dir() else []:
            for entry in os.scandir(directory):
                if not SHA256_RE.match(entry.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted while listed
                yield StoredBlob(entry.name, info.st_size, datetime.fromtimestamp(info.st_mtime, UTC))

    def delete_blob(self, sha256: str) -> None:
        self._unlink(self.local_blob_path(sha256))

    def delete_document(self, name: str) -> None:
        self._unlink(self._document_path(name))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc

    def check(self) -> None:
        # Readiness means "a write would succeed": the tmp dir exists and is writable.
        if not self._tmp.is_dir() or not os.access(self._tmp, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"the local store {self.root} is missing or not writable")
        usage = shutil.disk_usage(self._tmp)
        if usage.free == 0:
            raise StoreUnavailable(f"the local store {self.root} has no free space")
