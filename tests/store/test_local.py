"""LocalStore specifics: immutability on disk, no sharing with the caller's files, temp-file hygiene."""

from __future__ import annotations

import io
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from compilesvc.store import LocalStore

SECRET = b"k" * 32


def test_blob_does_not_share_the_source_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", public_url="http://x", secret_key=SECRET)
    source = tmp_path / "out.neff"
    source.write_bytes(b"compiled")
    info = store.put_file(source)
    source.write_bytes(b"overwritten by the next compile")  # in place: same inode if it were linked
    blob = store.local_blob_path(info.sha256)
    assert blob.read_bytes() == b"compiled"
    assert blob.stat().st_ino != source.stat().st_ino
    assert blob.stat().st_mode & 0o222 == 0  # read-only on disk


def test_stale_temp_files_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "store"
    LocalStore(root, public_url="http://x", secret_key=SECRET)
    stale, fresh = root / "tmp" / "w-stale", root / "tmp" / "w-fresh"
    stale.write_bytes(b"left by a killed writer")
    fresh.write_bytes(b"being written right now")
    old = time.time() - 2 * 24 * 3600
    os.utime(stale, (old, old))
    LocalStore(root, public_url="http://x", secret_key=SECRET)
    assert not stale.exists() and fresh.exists()


def test_sweep_removes_only_its_own_idle_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root, public_url="http://x", secret_key=SECRET)
    tmp = root / "tmp"
    idle, writing = tmp / "w-idle", tmp / "w-writing"
    foreign, directory = tmp / "someone-elses", tmp / "w-dir"
    for path in (idle, writing, foreign):
        path.write_bytes(b"partial")
    directory.mkdir()
    old = time.time() - 7200
    for path in (idle, writing, foreign, directory):
        os.utime(path, (old, old))
    with open(writing, "ab") as handle:  # an upload that started long ago but is still arriving
        handle.write(b" and more")
    assert store.sweep_incomplete_uploads(timedelta(hours=1)) == 1
    assert sorted(p.name for p in tmp.iterdir()) == ["someone-elses", "w-dir", "w-writing"]
    assert store.sweep_incomplete_uploads(timedelta(hours=1)) == 0


def test_source_read_errors_are_not_store_errors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", public_url="http://x", secret_key=SECRET)

    class Broken(io.RawIOBase):
        def read(self, size: int = -1) -> bytes:
            raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        store.put_stream(Broken())  # type: ignore[arg-type]
    assert list((tmp_path / "store" / "tmp").iterdir()) == []
    with pytest.raises(FileNotFoundError):
        store.put_file(tmp_path / "missing")
