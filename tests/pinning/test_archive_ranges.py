"""An uploaded checkpoint archive in the S3 store (weed) pinned by ranged reads: an uncompressed tar (what
``compilesvc upload DIR`` writes) costs its headers and config.json, not its weights; a compressed one is still
streamed; every refusal holds either way."""

from __future__ import annotations

import io
import json
import os
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from compilesvc.client.checkpoint_archive import write_archive
from compilesvc.config.settings import Settings
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelRefError
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store import S3Store, open_store
from tests.fixtures.checkpoints import Checkpoints, aliasing_archives, sha256_file, tar_of
from tests.fixtures.s3server import S3Server

WEIGHTS_BYTES = 24 * 1024**2


class Counted:
    """What a pin reads from an S3 store: bytes and requests, through every read the store offers."""

    def __init__(self, store: S3Store):
        self.store = store
        self.bytes = 0
        self.requests = 0
        count = self._count

        def open_blob(sha256: str) -> AbstractContextManager[BinaryIO]:
            return _CountingOpen(S3Store.open_blob(store, sha256), count)

        def read_blob_range(sha256: str, offset: int, length: int) -> bytes:
            data = S3Store.read_blob_range(store, sha256, offset, length)
            count(len(data))
            return data

        store.open_blob = open_blob  # type: ignore[method-assign]
        store.read_blob_range = read_blob_range  # type: ignore[method-assign]

    def _count(self, size: int | None) -> None:
        if size is None:
            self.requests += 1
        else:
            self.bytes += size
            self.requests += 1 if size else 0

    def reset(self) -> None:
        self.bytes = self.requests = 0


class _CountingOpen:
    def __init__(self, inner: AbstractContextManager[BinaryIO], count: Any):
        self.inner, self.count = inner, count

    def __enter__(self) -> Any:
        reader = self.inner.__enter__()
        count = self.count
        count(None)

        class Reading:
            def read(self, size: int = -1) -> bytes:
                data = reader.read(size)
                count(len(data))
                return data

        return Reading()

    def __exit__(self, *exc: object) -> Any:
        return self.inner.__exit__(*exc)


@pytest.fixture
def s3_store(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    s3_server.use_as_credential_chain(monkeypatch)
    bucket = s3_server.new_bucket("store")
    settings = Settings(data_dir=tmp_path / "data", store_url=f"s3://{bucket}/{uuid.uuid4().hex[:8]}",
                        s3_endpoint_url=s3_server.endpoint_url, s3_region=s3_server.region)
    store = open_store(settings)
    assert isinstance(store, S3Store)
    return store


def heavy_checkpoint(base: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with a large file beside it (sorted after config.json, before model.safetensors)."""
    directory = tmp_path / "heavy"
    directory.mkdir()
    for path in base.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    with open(directory / "consolidated.bin", "wb") as out:
        out.write(os.urandom(WEIGHTS_BYTES))
    return directory


def ref(uri: str) -> ModelRef:
    return ModelRef(uri=uri, format="hf-checkpoint")


def test_an_uploaded_archive_is_pinned_from_its_headers_and_config_not_its_weights(
        s3_store: S3Store, tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    directory = heavy_checkpoint(tiny_checkpoints.base, tmp_path)
    archive = io.BytesIO()
    write_archive(directory, archive)  # what `compilesvc upload DIR` sends
    size = len(archive.getvalue())
    uri = f"blob:sha256:{s3_store.put_stream(io.BytesIO(archive.getvalue())).sha256}"
    settings = Settings(data_dir=tmp_path / "data")
    counted = Counted(s3_store)

    pinned = ModelResolver(settings, s3_store, None).pin(ref(uri))
    assert pinned.checkpoint is not None and pinned.checkpoint.config == Checkpoints.config(directory)
    assert pinned.fetch["verify"] == {"config.json": sha256_file(directory / "config.json")}
    # Headers and config.json: a few buffered ranges per member, far from the archive's size.
    assert counted.bytes < size // 20 and counted.requests <= 4 * 4, (counted.bytes, counted.requests)

    counted.reset()
    weighed = ModelResolver(settings, s3_store, None).pin(ref(uri), weight_digests=True)
    assert counted.bytes >= size  # weights hashed: the archive is streamed, as it has to be read whole anyway
    assert weighed.checkpoint is not None and weighed.checkpoint.weights == {
        "model.safetensors": sha256_file(directory / "model.safetensors")}
    assert weighed.checkpoint.config == pinned.checkpoint.config


def test_a_compressed_archive_is_streamed_and_refusals_hold_over_ranged_reads(
        s3_store: S3Store, tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    resolver = ModelResolver(settings, s3_store, None)
    gz = tar_of(tiny_checkpoints.sharded, top="llama", gzip=True)
    counted = Counted(s3_store)
    pinned = resolver.pin(ref(f"blob:sha256:{s3_store.put_stream(io.BytesIO(gz)).sha256}"))
    assert pinned.checkpoint is not None and pinned.checkpoint.config == Checkpoints.config(tiny_checkpoints.sharded)
    assert counted.bytes >= len(gz)  # no offsets to seek to: read through

    for case, (data, member) in aliasing_archives(tiny_checkpoints.base).items():
        uri = f"blob:sha256:{s3_store.put_stream(io.BytesIO(data)).sha256}"
        with pytest.raises(ModelRefError) as raised:
            resolver.pin(ref(uri))
        assert repr(member) in raised.value.message, (case, raised.value.message)

    capped = ModelResolver(settings.model_copy(update={"hf_extract_max_files": 2}), s3_store, None)
    with pytest.raises(ModelRefError, match="more than 2 files"):
        capped.pin(ref(f"blob:sha256:{s3_store.put_stream(io.BytesIO(tar_of(tiny_checkpoints.base))).sha256}"))
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "pad": " " * 4 * 1024**2}))
    (huge / "model.safetensors").write_bytes(b"w")
    with pytest.raises(ModelRefError, match=r"config\.json in the archive is larger than 4 MiB"):
        resolver.pin(ref(f"blob:sha256:{s3_store.put_stream(io.BytesIO(tar_of(huge))).sha256}"))
