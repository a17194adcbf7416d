"""S3Store specifics on a real S3 server (weed): checksums, multipart, create-only races, aborts, errors."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from compilesvc.config.settings import Settings
from compilesvc.store import (
    LocalStore,
    S3Store,
    StoreError,
    StoreUnavailable,
    blob_name,
    open_store,
)
from compilesvc.store.s3_client import TRANSFER_CHUNK, composite_sha256
from tests.fixtures.s3server import S3Server
from tests.store.conftest import unique_prefix

MiB = 1024 * 1024


@pytest.fixture
def store(s3_env: S3Server, shared_bucket: str, tmp_path: Path) -> S3Store:
    return s3_store(s3_env, tmp_path, bucket=shared_bucket, prefix=unique_prefix())


def uploads(raw_s3: Any, store: S3Store) -> list[Any]:
    # Filtered here rather than with Prefix=, so a server ignoring Prefix cannot make this vacuous.
    listing = raw_s3.list_multipart_uploads(Bucket=store.bucket)
    return [u for u in listing.get("Uploads", []) if u["Key"].startswith(f"{store.prefix}/")]


def s3_store(server: S3Server, tmp_path: Path, *, bucket: str, prefix: str) -> S3Store:
    settings = Settings(data_dir=tmp_path / "data", store_url=f"s3://{bucket}/{prefix}",
                        s3_endpoint_url=server.endpoint_url, s3_region=server.region)
    store = open_store(settings)
    assert isinstance(store, S3Store)
    return store


@pytest.fixture
def big_file(tmp_path: Path) -> Path:
    path = tmp_path / "big.bin"
    with open(path, "wb") as out:
        for _ in range(20):
            out.write(os.urandom(MiB))
        out.write(b"tail")  # not a whole number of parts
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def test_open_store_picks_by_scheme(s3_env: S3Server, shared_bucket: str, tmp_path: Path) -> None:
    local = open_store(Settings(data_dir=tmp_path, secret_key="k"))  # default: data_dir/artifacts
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "artifacts").resolve()
    store = s3_store(s3_env, tmp_path, bucket=shared_bucket, prefix="/a/b/")
    assert (store.prefix, store.url) == ("a/b", f"s3://{shared_bucket}/a/b")
    assert store.create_client is not store.client  # writes get their own, create-only client
    for bad in ("http://example.com/x", "s3:///nobucket", "file://host/dir"):
        with pytest.raises(ValueError, match="store_url"):
            open_store(Settings(data_dir=tmp_path, store_url=bad, secret_key="k"))


def test_server_rejects_a_wrong_checksum(raw_s3: Any, shared_bucket: str) -> None:
    # Our integrity story rests on this: a body that does not match ChecksumSHA256 is refused.
    key = f"{unique_prefix()}/k"
    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    with pytest.raises(ClientError) as raised:
        raw_s3.put_object(Bucket=shared_bucket, Key=key, Body=b"these bytes", ChecksumSHA256=wrong)
    assert raised.value.response["Error"]["Code"] == "BadDigest"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert raw_s3.list_objects_v2(Bucket=shared_bucket, Prefix=key).get("KeyCount", 0) == 0


def test_large_file_goes_multipart_with_verified_sha256(
    store: S3Store, raw_s3: Any, tmp_path: Path, big_file: Path
) -> None:
    info = store.put_file(big_file)
    expected = file_sha256(big_file)
    assert (info.sha256, info.size, info.created) == (expected, 20 * MiB + 4, True)
    head = raw_s3.head_object(Bucket=store.bucket, Key=f"{store.prefix}/{blob_name(expected)}",
                              ChecksumMode="ENABLED")
    # Three parts, each checked by the server; the composite matches our own pass over the file.
    assert head["ChecksumSHA256"].endswith("-3")
    with open(big_file, "rb") as src:
        parts = [hashlib.sha256(src.read(TRANSFER_CHUNK)).digest() for _ in range(3)]
    assert head["ChecksumSHA256"] == composite_sha256(parts)
    dest = tmp_path / "back.bin"
    store.download_blob(expected, dest)
    assert file_sha256(dest) == expected
    # put_stream spools, then takes the same path; the blob already exists.
    with open(big_file, "rb") as src:
        assert store.put_stream(src).created is False


def test_the_server_lists_uploads_in_flight(store: S3Store, raw_s3: Any) -> None:
    """What makes ``uploads(...) == []`` below mean something: an upload left open is listed until aborted."""
    key = f"{store.prefix}/probe-{uuid.uuid4().hex}"
    upload_id = raw_s3.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
    try:
        assert [u["UploadId"] for u in uploads(raw_s3, store) if u["Key"] == key] == [upload_id]
    finally:
        raw_s3.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=upload_id)
    assert uploads(raw_s3, store) == []


def test_failed_multipart_upload_is_aborted(store: S3Store, raw_s3: Any, big_file: Path) -> None:

    def corrupt_second_part(request: Any, **_: Any) -> None:
        # The server then refuses part 2, after part 1 (and maybe 3) were stored: a mid-upload failure.
        if "partNumber=2" in request.url:
            request.headers["x-amz-checksum-sha256"] = base64.b64encode(hashlib.sha256(b"x").digest()).decode()

    store.create_client.meta.events.register("before-sign.s3.UploadPart", corrupt_second_part)
    with pytest.raises(StoreError):
        store.put_file(big_file)
    assert uploads(raw_s3, store) == []
    assert not store.has_blob(file_sha256(big_file))
    store.create_client.meta.events.unregister("before-sign.s3.UploadPart", corrupt_second_part)
    assert store.put_file(big_file).created


def test_upload_left_open_by_an_outage_is_swept_once_s3_is_back(
    store: S3Store, raw_s3: Any, big_file: Path
) -> None:
    """A part fails, and so does s3transfer's abort (S3 went down): the upload stays open until the sweep."""

    def corrupt_second_part(request: Any, **_: Any) -> None:
        if "partNumber=2" in request.url:
            request.headers["x-amz-checksum-sha256"] = base64.b64encode(hashlib.sha256(b"x").digest()).decode()

    def s3_is_down(**_: Any) -> None:
        raise EndpointConnectionError(endpoint_url="http://s3.down")

    events = store.create_client.meta.events
    events.register("before-sign.s3.UploadPart", corrupt_second_part)
    events.register("before-send.s3.AbortMultipartUpload", s3_is_down)
    try:
        with pytest.raises(StoreError):
            store.put_file(big_file)
    finally:
        events.unregister("before-sign.s3.UploadPart", corrupt_second_part)
        events.unregister("before-send.s3.AbortMultipartUpload", s3_is_down)
    assert len(uploads(raw_s3, store)) == 1, "the failed abort left the upload open"
    assert store.sweep_incomplete_uploads(timedelta(hours=1)) == 0  # too young to be called abandoned
    time.sleep(3)  # age is judged by the server's clock, in whole seconds
    assert store.sweep_incomplete_uploads(timedelta(seconds=1)) == 1
    assert uploads(raw_s3, store) == []
    assert not store.has_blob(file_sha256(big_file))
    assert store.put_file(big_file).created


def test_sweep_stays_inside_the_stores_blobs(store: S3Store, raw_s3: Any) -> None:
    """Uploads of another deployment sharing the bucket (even one whose prefix extends ours) are not ours."""

    def open_upload(key: str) -> str:
        return str(raw_s3.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"])

    blob = blob_name("ab" * 32)
    ours = open_upload(f"{store.prefix}/{blob}")
    foreign = {open_upload(f"{store.prefix}-other/{blob}"): f"{store.prefix}-other/{blob}",
               open_upload(f"{unique_prefix()}/{blob}"): "elsewhere",
               open_upload(f"{store.prefix}/not-blobs/{uuid.uuid4().hex}"): "not a blob"}
    time.sleep(3)
    assert store.sweep_incomplete_uploads(timedelta(seconds=1)) == 1
    still_open = {u["UploadId"] for u in raw_s3.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])}
    assert ours not in still_open
    assert set(foreign) <= still_open
    for upload in raw_s3.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []):
        if upload["UploadId"] in foreign:
            raw_s3.abort_multipart_upload(Bucket=store.bucket, Key=upload["Key"], UploadId=upload["UploadId"])


@pytest.mark.parametrize("size", [1000, 20 * MiB], ids=["single-put", "multipart"])
def test_conditional_create_when_another_writer_wins_the_race(
    store: S3Store, raw_s3: Any, tmp_path: Path, size: int
) -> None:
    """Another writer stores the blob between our HEAD and our write: If-None-Match turns ours into a no-op."""
    data = os.urandom(size)
    key = f"{store.prefix}/{blob_name(hashlib.sha256(data).hexdigest())}"
    rival = b"rival bytes: proves our write did not overwrite"
    operation = "PutObject" if size < TRANSFER_CHUNK else "CompleteMultipartUpload"

    def rival_writes_first(**_: Any) -> None:
        raw_s3.put_object(Bucket=store.bucket, Key=key, Body=rival)

    store.create_client.meta.events.register(f"before-call.s3.{operation}", rival_writes_first)
    try:
        source = tmp_path / "blob"
        source.write_bytes(data)
        # HEAD misses, then the rival writes, then our PUT/Complete gets 412: created=False, nothing lost.
        # (The size check below is only reached through the HEAD path, not here.)
        info = store.put_file(source)
    finally:
        store.create_client.meta.events.unregister(f"before-call.s3.{operation}", rival_writes_first)
    assert info.created is False
    assert raw_s3.get_object(Bucket=store.bucket, Key=key)["Body"].read() == rival
    assert uploads(raw_s3, store) == []


def test_existing_blob_with_wrong_size_is_reported(store: S3Store, raw_s3: Any) -> None:
    data = b"the real content"
    key = f"{store.prefix}/{blob_name(hashlib.sha256(data).hexdigest())}"
    raw_s3.put_object(Bucket=store.bucket, Key=key, Body=b"x")  # a truncated object at data's name
    with pytest.raises(StoreError, match="corrupt"):
        store.put_stream(io.BytesIO(data))


def test_unreachable_endpoint_is_store_unavailable(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    settings = Settings(data_dir=tmp_path, store_url="s3://nowhere/p",
                        s3_endpoint_url=f"http://127.0.0.1:{closed_port}")
    store = open_store(settings)
    with pytest.raises(StoreUnavailable):
        store.check()
    with pytest.raises(StoreUnavailable):
        store.blob_size("0" * 64)
    with pytest.raises(StoreUnavailable):
        store.put_stream(io.BytesIO(b"data"))
    with pytest.raises(StoreUnavailable):
        store.create_document("d.json", b"{}")
    with pytest.raises(StoreUnavailable):
        store.sweep_incomplete_uploads(timedelta(hours=1))


def test_bad_credentials_and_missing_bucket_are_store_unavailable(
    s3_env: S3Server, shared_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(StoreUnavailable, match="does not exist"):
        s3_store(s3_env, tmp_path, bucket="no-such-bucket-here", prefix="p").check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    store = s3_store(s3_env, tmp_path, bucket=shared_bucket, prefix=unique_prefix())
    with pytest.raises(StoreUnavailable):
        store.check()
    with pytest.raises(StoreUnavailable):
        store.put_stream(io.BytesIO(b"data"))
