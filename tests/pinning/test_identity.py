"""Model pinning and fetching against real servers: weed for S3, Postgres and SQLite for model_pins."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ModelPin
from compilesvc.pinning.identity import ModelResolver, content_sha256_for_key
from compilesvc.pinning.pins import ModelChangedError, ModelRefError, PinnedModel
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store import IntegrityError, LocalStore
from tests.fixtures.s3server import S3Server


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def raw(s3: S3Server) -> Any:
    return s3.raw_client()


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    """One bucket for the module (creating buckets is slow on weed); each test keys under ``keyp``."""
    return s3_server.new_bucket("models")


@pytest.fixture
def keyp() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def settings(tmp_path: Path, s3: S3Server) -> Settings:
    return Settings(data_dir=tmp_path / "data", s3_endpoint_url=s3.endpoint_url, s3_region=s3.region)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "artifacts", public_url="http://127.0.0.1:1", secret_key=b"k" * 32)


def pin_rows(sessions: sessionmaker[Session]) -> int:
    with transaction(sessions) as session:
        return int(session.scalar(select(func.count()).select_from(ModelPin)) or 0)


def count_gets(resolver: ModelResolver) -> list[int]:
    """Count GetObject calls the resolver's client makes (botocore's own event hook, no mocking)."""
    calls = [0]

    def counted(**_: Any) -> None:
        calls[0] += 1

    resolver.s3_client.meta.events.register("before-call.s3.GetObject", counted)
    return calls


def ref(uri: str, **extra: Any) -> ModelRef:
    return ModelRef(uri=uri, format="torchscript", **extra)


# -- blob: ---------------------------------------------------------------------------------------------


def test_blob_present_and_missing(settings: Settings, store: LocalStore, tmp_path: Path) -> None:
    resolver = ModelResolver(settings, store, None)
    data = b"an uploaded torchscript model"
    info = store.put_stream(io.BytesIO(data))
    pinned = resolver.pin(ref(f"blob:sha256:{info.sha256}"))
    assert (pinned.sha256, pinned.size, pinned.format) == (info.sha256, len(data), "torchscript")
    assert pinned.fetch == {"kind": "blob", "sha256": info.sha256}
    assert PinnedModel.from_json(pinned.as_json()) == pinned
    resolver.fetch(pinned.fetch, tmp_path / "model.pt")
    assert (tmp_path / "model.pt").read_bytes() == data

    missing = sha(b"not uploaded")
    with pytest.raises(ModelRefError) as raised:
        resolver.pin(ref(f"blob:sha256:{missing}"))
    assert raised.value.field == "model.uri"
    assert str(raised.value) == (f"model.uri: blob sha256:{missing} is not uploaded: upload the model first "
                                 "(`compilesvc upload FILE`, or POST /v1/models)")


# -- s3:// ---------------------------------------------------------------------------------------------


def test_s3_versioned_bucket_pins_version_ids(
    settings: Settings, sessions: sessionmaker[Session], raw: Any, s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.new_bucket("ver")
    raw.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    v1 = raw.put_object(Bucket=bucket, Key="models/m.pt", Body=b"version one")["VersionId"]
    v2 = raw.put_object(Bucket=bucket, Key="models/m.pt", Body=b"version two!")["VersionId"]
    resolver = ModelResolver(settings, None, sessions)

    old = resolver.pin(ref(f"s3://{bucket}/models/m.pt", version_id=v1))
    assert (old.sha256, old.size) == (sha(b"version one"), 11)
    assert old.fetch["kind"] == "s3" and old.fetch["version_id"] == v1
    current = resolver.pin(ref(f"s3://{bucket}/models/m.pt"))
    assert current.sha256 == sha(b"version two!")
    assert current.fetch["version_id"] == v2  # no version asked for: pinned to the current one

    raw.put_object(Bucket=bucket, Key="models/m.pt", Body=b"version three")
    resolver.fetch(old.fetch, tmp_path / "old.pt")
    resolver.fetch(current.fetch, tmp_path / "current.pt")
    assert (tmp_path / "old.pt").read_bytes() == b"version one"
    assert (tmp_path / "current.pt").read_bytes() == b"version two!"
    assert pin_rows(sessions) == 2

    with pytest.raises(ModelRefError) as raised:
        resolver.pin(ref(f"s3://{bucket}/models/m.pt", version_id="no-such-version"))
    assert raised.value.field == "model.version_id"


def test_s3_unversioned_pinned_by_etag_then_replaced(
    settings: Settings, sessions: sessionmaker[Session], raw: Any, bucket: str, keyp: str, tmp_path: Path
) -> None:
    etag = raw.put_object(Bucket=bucket, Key=f"{keyp}/m.pt", Body=b"original")["ETag"]
    resolver = ModelResolver(settings, None, sessions)
    pinned = resolver.pin(ref(f"s3://{bucket}/{keyp}/m.pt"))
    assert pinned.fetch == {
        "kind": "s3", "bucket": bucket, "key": f"{keyp}/m.pt", "version_id": None, "etag": etag, "size": 8,
        "sha256": sha(b"original"),
    }
    raw.put_object(Bucket=bucket, Key=f"{keyp}/m.pt", Body=b"replaced")  # same size, other bytes
    with pytest.raises(ModelChangedError, match="changed since it was pinned"):
        resolver.fetch(pinned.fetch, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()
    assert list(tmp_path.glob(".m.pt*")) == []
    assert resolver.pin(ref(f"s3://{bucket}/{keyp}/m.pt")).sha256 == sha(b"replaced")
    raw.delete_object(Bucket=bucket, Key=f"{keyp}/m.pt")
    with pytest.raises(ModelChangedError):
        resolver.fetch(pinned.fetch, tmp_path / "m.pt")


def test_s3_pin_is_remembered_in_the_ledger(
    settings: Settings, sessions: sessionmaker[Session], raw: Any, bucket: str, keyp: str
) -> None:
    raw.put_object(Bucket=bucket, Key=f"{keyp}/big.pt", Body=b"weights" * 1000)
    first = ModelResolver(settings, None, sessions)
    gets = count_gets(first)
    pinned = first.pin(ref(f"s3://{bucket}/{keyp}/big.pt"))
    assert pinned.sha256 == sha(b"weights" * 1000)
    assert gets == [1] and pin_rows(sessions) == 1

    # Replace the remembered sha256 with a sentinel: a fresh resolver (no process-local state) that
    # answers with the sentinel can only have read it from the row, never from the object's bytes.
    sentinel = "f" * 64
    with transaction(sessions) as session:
        session.execute(update(ModelPin).values(sha256=sentinel))
    second = ModelResolver(settings, None, sessions)
    second_gets = count_gets(second)
    assert second.pin(ref(f"s3://{bucket}/{keyp}/big.pt")).sha256 == sentinel
    assert second_gets == [0] and pin_rows(sessions) == 1

    # Without a ledger the sha256 is computed every time and nothing is written.
    unremembered = ModelResolver(settings, None, None)
    assert unremembered.pin(ref(f"s3://{bucket}/{keyp}/big.pt")).sha256 == pinned.sha256


def test_concurrent_pins_write_one_row(
    settings: Settings, sessions: sessionmaker[Session], raw: Any, bucket: str, keyp: str
) -> None:
    raw.put_object(Bucket=bucket, Key=f"{keyp}/m.pt", Body=b"shared model")
    barrier = threading.Barrier(4)
    results: list[str] = []

    def pin() -> None:
        resolver = ModelResolver(settings, None, sessions)
        barrier.wait()
        results.append(resolver.pin(ref(f"s3://{bucket}/{keyp}/m.pt")).sha256)

    threads = [threading.Thread(target=pin) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [sha(b"shared model")] * 4
    assert pin_rows(sessions) == 1


def test_s3_refusals(settings: Settings, raw: Any, bucket: str, keyp: str) -> None:
    raw.put_object(Bucket=bucket, Key=f"{keyp}/tree/a.bin", Body=b"a")
    raw.put_object(Bucket=bucket, Key=f"{keyp}/marker", Body=b"", ContentType="application/x-directory")
    resolver = ModelResolver(settings, None, None)
    with pytest.raises(ModelRefError, match=r"^model\.uri: .*does not exist$"):
        resolver.pin(ref(f"s3://{bucket}/{keyp}/nothing.pt"))
    with pytest.raises(ModelRefError, match=r"is a prefix .*upload a tar"):
        resolver.pin(ref(f"s3://{bucket}/{keyp}/tree"))
    with pytest.raises(ModelRefError, match="directory marker"):
        resolver.pin(ref(f"s3://{bucket}/{keyp}/marker"))
    with pytest.raises(ModelRefError, match="does not exist"):
        resolver.pin(ref("s3://no-such-bucket-anywhere/m.pt"))


def test_s3_keys_are_not_url_encoded(
    settings: Settings, raw: Any, bucket: str, keyp: str, tmp_path: Path
) -> None:
    key = f"{keyp}/models/my model?v=1#final.pt"
    raw.put_object(Bucket=bucket, Key=key, Body=b"odd key")
    resolver = ModelResolver(settings, None, None)
    pinned = resolver.pin(ref(f"s3://{bucket}/{key}"))
    assert (pinned.fetch["key"], pinned.sha256) == (key, sha(b"odd key"))
    resolver.fetch(pinned.fetch, tmp_path / "m.pt")
    assert (tmp_path / "m.pt").read_bytes() == b"odd key"


def test_fetch_verifies_sha256(settings: Settings, raw: Any, bucket: str, keyp: str, tmp_path: Path) -> None:
    raw.put_object(Bucket=bucket, Key=f"{keyp}/m.pt", Body=b"bytes")
    resolver = ModelResolver(settings, None, None)
    pinned = resolver.pin(ref(f"s3://{bucket}/{keyp}/m.pt"))
    with pytest.raises(IntegrityError):
        resolver.fetch({**pinned.fetch, "sha256": sha(b"other")}, tmp_path / "m.pt")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        resolver.fetch({"kind": "ftp", "sha256": pinned.sha256}, tmp_path / "m.pt")


# -- file:// -------------------------------------------------------------------------------------------


def test_file_models_refused_unless_allowed(settings: Settings, tmp_path: Path) -> None:
    model = tmp_path / "m.pt"
    model.write_bytes(b"local model")
    with pytest.raises(ModelRefError, match=r"^model\.uri: file:// models are disabled"):
        ModelResolver(settings, None, None).pin(ref(model.as_uri()))


def test_file_models_when_allowed(settings: Settings, tmp_path: Path) -> None:
    resolver = ModelResolver(settings.model_copy(update={"allow_file_models": True}), None, None)
    model = tmp_path / "m.pt"
    model.write_bytes(b"local model")
    pinned = resolver.pin(ref(model.as_uri()))
    assert (pinned.sha256, pinned.size, pinned.fetch["kind"]) == (sha(b"local model"), 11, "file")
    out = tmp_path / "out"
    out.mkdir()
    resolver.fetch(pinned.fetch, out / "m.pt")
    assert (out / "m.pt").read_bytes() == b"local model"

    with pytest.raises(ModelRefError, match="is a directory; upload a tar of the directory"):
        resolver.pin(ref(tmp_path.as_uri()))
    with pytest.raises(ModelRefError, match="does not exist"):
        resolver.pin(ref((tmp_path / "absent.pt").as_uri()))

    # Remembered by (path, size, mtime_ns): same size and mtime is taken to be the same content...
    stat = model.stat()
    model.write_bytes(b"LOCAL MODEL")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert resolver.pin(ref(model.as_uri())).sha256 == pinned.sha256
    # ...which the worker's verification still catches.
    with pytest.raises(IntegrityError):
        resolver.fetch(pinned.fetch, out / "again.pt")
    # A visible change is a changed model.
    model.write_bytes(b"a longer local model")
    with pytest.raises(ModelChangedError):
        resolver.fetch(pinned.fetch, out / "again.pt")
    assert resolver.pin(ref(model.as_uri())).sha256 == sha(b"a longer local model")


def test_content_sha256_for_key(settings: Settings, raw: Any, bucket: str, keyp: str, tmp_path: Path) -> None:
    digest = sha(b"anything")
    assert content_sha256_for_key(ref(f"blob:sha256:{digest}"), settings) == digest
    model = tmp_path / "m.pt"
    model.write_bytes(b"on my laptop")
    assert not settings.allow_file_models
    assert content_sha256_for_key(ref(model.as_uri()), settings) == sha(b"on my laptop")
    raw.put_object(Bucket=bucket, Key=f"{keyp}/m.pt", Body=b"in s3")
    assert content_sha256_for_key(ref(f"s3://{bucket}/{keyp}/m.pt"), settings) == sha(b"in s3")
