"""One conformance suite for every ArtifactStore: LocalStore and S3Store (on a real weed server)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests

from compilesvc.store import (
    BlobNotFound,
    BlobTooLarge,
    DigestMismatch,
    IntegrityError,
    SizeMismatch,
    artifact_manifest_name,
)
from tests.store.conftest import StoreCase


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_round_trip(case: StoreCase, tmp_path: Path) -> None:
    store = case.store
    data = os.urandom(300_000)
    info = store.put_stream(io.BytesIO(data))
    assert (info.sha256, info.size, info.created) == (sha(data), len(data), True)
    assert store.has_blob(info.sha256)
    assert store.blob_size(info.sha256) == len(data)
    with store.open_blob(info.sha256) as reader:
        assert reader.read() == data
    assert b"".join(store.iter_blob(info.sha256, chunk_size=65536)) == data
    dest = tmp_path / "out.bin"
    store.download_blob(info.sha256, dest)
    assert dest.read_bytes() == data


def test_content_addressing_and_created_flag(case: StoreCase, tmp_path: Path) -> None:
    store = case.store
    data = b"compiled neff bytes"
    source = tmp_path / "model.neff"
    source.write_bytes(data)
    first = store.put_file(source)
    assert first.sha256 == sha(data) and first.created
    # The same content again, by either path, is the same blob and is not "created" again.
    assert store.put_file(source).created is False
    again = store.put_stream(io.BytesIO(data))
    assert (again.sha256, again.size, again.created) == (first.sha256, len(data), False)
    other = store.put_stream(io.BytesIO(data + b"!"))
    assert other.sha256 != first.sha256 and other.created
    assert f"blobs/sha256/{first.sha256[:2]}/{first.sha256}" in case.list_names()
    # Nothing but the two blobs was left behind (no temp files, no documents).
    assert [n for n in case.list_names() if not n.startswith("blobs/")] == []


def test_empty_blob(case: StoreCase, tmp_path: Path) -> None:
    info = case.store.put_stream(io.BytesIO(b""))
    assert (info.sha256, info.size, info.created) == (sha(b""), 0, True)
    case.store.download_blob(info.sha256, tmp_path / "empty")
    assert (tmp_path / "empty").read_bytes() == b""


def test_missing_blob(case: StoreCase, tmp_path: Path) -> None:
    missing = sha(b"never stored")
    assert case.store.blob_size(missing) is None
    assert not case.store.has_blob(missing)
    with pytest.raises(BlobNotFound), case.store.open_blob(missing):
        pass
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BlobNotFound):
        case.store.download_blob(missing, out / "x")
    assert list(out.iterdir()) == []  # no partial download left behind


def test_ranged_reads_read_only_the_range_asked_for(case: StoreCase) -> None:
    store = case.store
    data = os.urandom(200_000)
    sha256 = store.put_stream(io.BytesIO(data)).sha256
    for offset, length in [(0, 512), (1, 1), (65_536, 100_000), (199_990, 10), (199_990, 1000), (200_000, 5),
                           (250_000, 5), (7, 0)]:
        assert store.read_blob_range(sha256, offset, length) == data[offset:offset + length], (offset, length)
    with store.open_blob_ranged(sha256) as reader:
        assert reader.seekable()
        reader.seek(150_000)
        assert reader.read(512) == data[150_000:150_512]
        reader.seek(-10, os.SEEK_END)
        assert reader.read() == data[-10:] and reader.read(1) == b""
        reader.seek(3)
        assert reader.tell() == 3 and reader.read(70_000) == data[3:70_003]
    missing = sha(b"never stored")
    with pytest.raises(BlobNotFound):
        store.read_blob_range(missing, 0, 10)
    with pytest.raises(BlobNotFound), store.open_blob_ranged(missing):
        pass


def test_documents_are_create_only(case: StoreCase) -> None:
    store = case.store
    name = artifact_manifest_name("a" * 64)
    assert store.read_document(name) is None
    assert store.create_document(name, b'{"v": 1}') is True
    assert store.create_document(name, b'{"v": 2}') is False
    assert store.read_document(name) == b'{"v": 1}'
    location = store.document_location(name)
    assert location.startswith("file://" if case.kind == "local" else "s3://")
    assert location.endswith(name)


def test_concurrent_create_document_has_one_winner(case: StoreCase) -> None:
    name = "buckets/race/manifest.json"
    threads = 8
    barrier = threading.Barrier(threads)
    results: dict[int, bool] = {}
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            barrier.wait()
            results[i] = case.store.create_document(name, f'{{"writer": {i}}}'.encode())
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    winners = [i for i, created in results.items() if created]
    assert len(winners) == 1 and len(results) == threads
    assert case.store.read_document(name) == f'{{"writer": {winners[0]}}}'.encode()


def test_download_verifies_sha256(case: StoreCase, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    info = case.store.put_stream(io.BytesIO(data))
    case.corrupt_blob(info.sha256, data[:-1] + bytes([data[-1] ^ 1]))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(IntegrityError):
        case.store.download_blob(info.sha256, out / "dest.bin")
    assert list(out.iterdir()) == []  # neither the file nor a partial download


def test_blob_too_large_leaves_nothing_behind(case: StoreCase, isolated_tmp: Path) -> None:
    data = os.urandom(4096)
    with pytest.raises(BlobTooLarge) as raised:
        case.store.put_stream(io.BytesIO(data), max_bytes=4095)
    assert raised.value.limit == 4095
    assert not case.store.has_blob(sha(data))
    assert case.list_names() == []
    assert list(isolated_tmp.iterdir()) == []  # no spool file either
    # Exactly at the limit is fine.
    assert case.store.put_stream(io.BytesIO(data), max_bytes=4096).created
    assert list(isolated_tmp.iterdir()) == []


def test_blob_url_downloads_then_expires(case: StoreCase) -> None:
    data = os.urandom(10_000)
    info = case.store.put_stream(io.BytesIO(data))
    plain = case.store.blob_url(info.sha256, expires_in=600)
    url = case.store.blob_url(info.sha256, expires_in=60, filename="bucket 3.neff")
    response = requests.get(url, timeout=10)
    assert response.status_code == 200
    assert response.content == data
    assert 'filename="bucket 3.neff"' in response.headers["Content-Disposition"]
    assert requests.get(plain, timeout=10).content == data
    with case.signed_ago(120):  # a 60-second URL signed two minutes ago has expired
        expired = case.store.blob_url(info.sha256, expires_in=60, filename="bucket 3.neff")
        still_valid = case.store.blob_url(info.sha256, expires_in=600)
    assert requests.get(expired, timeout=10).status_code == 403
    assert requests.get(still_valid, timeout=10).content == data
    # The filename is part of what is signed: it cannot be swapped on a live URL.
    tampered = plain + "&filename=evil.sh" if case.kind == "local" else plain.replace(info.sha256, sha(b"x"))
    assert requests.get(tampered, timeout=10).status_code == 403


def test_check(case: StoreCase) -> None:
    case.store.check()


MiB = 1024 * 1024


def assert_nothing_stored(case: StoreCase, spool_dir: Path, *contents: bytes) -> None:
    """No blob of any of ``contents``, no object or document, no temp or spool file, no open upload."""
    for data in contents:
        assert not case.store.has_blob(sha(data))
    assert case.list_names() == []
    assert case.open_uploads() == set()
    assert list(spool_dir.iterdir()) == []


def test_short_stream_is_refused(case: StoreCase, isolated_tmp: Path) -> None:
    # Past the multipart threshold (8 MiB) either way: a refusal must not even start an S3 upload.
    data = os.urandom(20 * MiB + 3)
    cut = data[: 12 * MiB]
    with pytest.raises(SizeMismatch) as raised:
        case.store.put_stream(io.BytesIO(cut), expected_size=len(data))
    assert (raised.value.expected, raised.value.received) == (len(data), len(cut))
    assert_nothing_stored(case, isolated_tmp, cut, data)
    # More than declared is refused the same way.
    with pytest.raises(SizeMismatch):
        case.store.put_stream(io.BytesIO(data), expected_size=len(cut))
    assert_nothing_stored(case, isolated_tmp, cut, data)
    # The whole body, as declared, is stored.
    info = case.store.put_stream(io.BytesIO(data), expected_size=len(data), expected_sha256=sha(data))
    assert (info.sha256, info.size, info.created) == (sha(data), len(data), True)
    assert case.list_names() == [f"blobs/sha256/{info.sha256[:2]}/{info.sha256}"]
    assert case.open_uploads() == set()


def test_digest_mismatch_is_refused(case: StoreCase, isolated_tmp: Path) -> None:
    data = os.urandom(300_000)
    claimed = sha(data[:-1] + bytes([data[-1] ^ 1]))  # one bit off
    with pytest.raises(DigestMismatch) as raised:
        case.store.put_stream(io.BytesIO(data), expected_size=len(data), expected_sha256=claimed)
    assert (raised.value.expected, raised.value.actual) == (claimed, sha(data))
    assert_nothing_stored(case, isolated_tmp, data)
    # Identical content already stored does not make a mismatched write succeed.
    case.store.put_stream(io.BytesIO(data))
    with pytest.raises(DigestMismatch):
        case.store.put_stream(io.BytesIO(data), expected_sha256=claimed)
    assert not case.store.has_blob(claimed)


def test_malformed_expectations_are_refused_before_reading(case: StoreCase) -> None:
    source = io.BytesIO(b"never read")
    with pytest.raises(ValueError):
        case.store.put_stream(source, expected_sha256="ABC")
    with pytest.raises(ValueError):
        case.store.put_stream(source, expected_size=-1)
    with pytest.raises(BlobTooLarge):
        case.store.put_stream(source, max_bytes=4, expected_size=5)
    assert source.tell() == 0
    assert case.list_names() == []


class DroppedConnection(io.RawIOBase):
    """A body whose connection drops after ``size`` bytes: the read raises, as gunicorn's chunk parser does."""

    def __init__(self, data: bytes):
        self.data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        chunk = self.data.read(len(buffer))
        if not chunk:
            raise ConnectionResetError("the peer went away mid-body")
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_failing_stream_leaves_nothing(case: StoreCase, isolated_tmp: Path) -> None:
    data = os.urandom(3 * MiB)
    with pytest.raises(ConnectionResetError):
        case.store.put_stream(io.BufferedReader(DroppedConnection(data)))
    assert_nothing_stored(case, isolated_tmp, data)


@pytest.mark.slow
def test_sweep_removes_abandoned_uploads_only(case: StoreCase) -> None:
    stale = case.abandon_upload()
    active = case.abandon_upload()
    # The sweep judges age by the store's clock (S3: the server's Date, whole seconds): let time pass.
    time.sleep(4)
    case.resume_upload(active)  # started as long ago as `stale`, but still receiving bytes
    fresh = case.abandon_upload()
    assert case.open_uploads() == {stale, active, fresh}
    assert case.store.sweep_incomplete_uploads(timedelta(hours=1)) == 0
    assert case.open_uploads() == {stale, active, fresh}
    assert case.store.sweep_incomplete_uploads(timedelta(seconds=2)) == 1
    assert case.open_uploads() == {active, fresh}
    assert case.store.sweep_incomplete_uploads(timedelta(seconds=2)) == 0  # idempotent
    # Finished blobs are not uploads: the sweep leaves them alone.
    info = case.store.put_stream(io.BytesIO(b"stored before a sweep"))
    assert case.store.sweep_incomplete_uploads(timedelta(seconds=2)) == 0
    assert case.store.has_blob(info.sha256)
    assert case.open_uploads() == {active, fresh}


def test_blobs_are_listed_and_deleted(case: StoreCase) -> None:
    store = case.store
    before = datetime.now(UTC) - timedelta(seconds=5)
    kept = store.put_stream(io.BytesIO(b"kept blob"))
    gone = store.put_stream(io.BytesIO(b"deleted blob" * 1000))
    listed = {b.sha256: b for b in store.iter_blobs()}
    assert set(listed) == {kept.sha256, gone.sha256}
    assert listed[gone.sha256].size == gone.size
    assert before <= listed[gone.sha256].modified <= datetime.now(UTC) + timedelta(seconds=5)

    store.delete_blob(gone.sha256)
    assert not store.has_blob(gone.sha256) and store.has_blob(kept.sha256)
    assert {b.sha256 for b in store.iter_blobs()} == {kept.sha256}
    store.delete_blob(gone.sha256)  # not there: nothing happens
    again = store.put_stream(io.BytesIO(b"deleted blob" * 1000))
    assert again.created and again.sha256 == gone.sha256  # the content can be stored again


def test_documents_are_deleted_and_may_be_created_again(case: StoreCase) -> None:
    store = case.store
    name = artifact_manifest_name("d" * 64)
    assert store.create_document(name, b'{"v": 1}')
    store.delete_document(name)
    assert store.read_document(name) is None
    store.delete_document(name)  # not there: nothing happens
    assert store.create_document(name, b'{"v": 2}') is True  # create-only still: the name is free again
    assert store.read_document(name) == b'{"v": 2}'
    assert [b for b in store.iter_blobs()] == []  # documents are not blobs


def test_a_declared_stream_is_stored_as_it_arrives_and_refused_whole(case: StoreCase, isolated_tmp: Path) -> None:
    """Size and sha256 declared (what ``compilesvc upload`` sends): the S3 store uploads parts while the
    body is still arriving. Whatever goes wrong before the last byte matched, nothing is published and no
    multipart upload is left open."""
    data = os.urandom(20 * MiB + 3)  # three parts
    digest = sha(data)
    with pytest.raises(SizeMismatch) as short:
        case.store.put_stream(io.BytesIO(data[: 17 * MiB]), expected_size=len(data), expected_sha256=digest)
    assert (short.value.expected, short.value.received) == (len(data), 17 * MiB)
    assert_nothing_stored(case, isolated_tmp, data)
    with pytest.raises(SizeMismatch):  # longer than declared
        case.store.put_stream(io.BytesIO(data + b"x"), expected_size=len(data), expected_sha256=digest)
    assert_nothing_stored(case, isolated_tmp, data)
    flipped = data[:-1] + bytes([data[-1] ^ 1])  # the last byte, in the last part, one bit off
    with pytest.raises(DigestMismatch) as mismatch:
        case.store.put_stream(io.BytesIO(flipped), expected_size=len(data), expected_sha256=digest)
    assert (mismatch.value.expected, mismatch.value.actual) == (digest, sha(flipped))
    assert_nothing_stored(case, isolated_tmp, data, flipped)
    with pytest.raises(ConnectionResetError):  # the client went away after two parts
        case.store.put_stream(io.BufferedReader(DroppedConnection(data[: 16 * MiB + 5])), expected_size=len(data),
                              expected_sha256=digest)
    assert_nothing_stored(case, isolated_tmp, data)

    spooled: list[list[Path]] = []

    class Watched(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            spooled.append(list(isolated_tmp.iterdir()))
            return super().read(size)

    info = case.store.put_stream(Watched(data), expected_size=len(data), expected_sha256=digest)
    assert (info.sha256, info.size, info.created) == (digest, len(data), True)
    if case.kind == "s3":  # streamed to S3: never a spool file
        assert spooled and not any(spooled)
    with case.store.open_blob(digest) as stored:
        assert stored.read() == data
    # Stored already: the bytes are still read and checked before the answer says so.
    again = case.store.put_stream(io.BytesIO(data), expected_size=len(data), expected_sha256=digest)
    assert (again.sha256, again.created) == (digest, False)
    with pytest.raises(DigestMismatch):
        case.store.put_stream(io.BytesIO(flipped), expected_size=len(data), expected_sha256=digest)
    assert case.open_uploads() == set() and list(isolated_tmp.iterdir()) == []


@pytest.mark.parametrize("size", [0, 1, 8 * MiB - 1, 8 * MiB, 8 * MiB + 1])
def test_a_declared_stream_at_the_part_boundaries(case: StoreCase, isolated_tmp: Path, size: int) -> None:
    """One PUT below the multipart threshold, one part at it, two parts past it: each stored whole."""
    data = os.urandom(size)
    info = case.store.put_stream(io.BytesIO(data), expected_size=size, expected_sha256=sha(data))
    assert (info.sha256, info.size, info.created) == (sha(data), size, True)
    with case.store.open_blob(info.sha256) as stored:
        assert stored.read() == data
    assert case.open_uploads() == set() and list(isolated_tmp.iterdir()) == []
