"""hf-checkpoint models pinned and fetched against real parts: a tiny Llama checkpoint saved by transformers, as an
archive in the local store, as a prefix in a versioned bucket on weed (the real S3 server) and as a directory."""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelChangedError, ModelRefError, PinnedModel
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store import LocalStore
from tests.fixtures.checkpoints import Checkpoints, aliasing_archives, sha256_file, tar_of
from tests.fixtures.s3server import S3Server


def ref(uri: str) -> ModelRef:
    return ModelRef(uri=uri, format="hf-checkpoint")


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "artifacts", public_url="http://127.0.0.1:1", secret_key=b"k" * 32)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data")


def upload(store: LocalStore, data: bytes) -> str:
    return f"blob:sha256:{store.put_stream(io.BytesIO(data)).sha256}"


# -- blob: an archive in the store -------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [None, "tiny-llama"])
def test_an_archive_is_pinned_with_its_config_and_weights_only_when_asked(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints, tmp_path: Path, top: str | None) -> None:
    base = tiny_checkpoints.base
    data = tar_of(base, top=top)
    uri = upload(store, data)
    resolver = ModelResolver(settings, store, None)
    pinned = resolver.pin(ref(uri))
    assert pinned.sha256 == uri.removeprefix("blob:sha256:") and pinned.size == len(data)
    assert pinned.fetch == {"kind": "blob", "sha256": pinned.sha256,
                            "verify": {"config.json": sha256_file(base / "config.json")}}
    assert pinned.checkpoint is not None
    assert pinned.checkpoint.config == Checkpoints.config(base)
    assert pinned.checkpoint.weights is None  # not read: the key does not need them
    assert PinnedModel.from_json(json.loads(json.dumps(pinned.as_json()))) == pinned

    with_weights = resolver.pin(ref(uri), weight_digests=True)
    assert with_weights.checkpoint is not None
    assert with_weights.checkpoint.weights == {"model.safetensors": sha256_file(base / "model.safetensors")}
    assert with_weights.fetch["verify"] == {"config.json": sha256_file(base / "config.json"),
                                            **with_weights.checkpoint.weights}
    resolver.fetch(pinned.fetch, tmp_path / "checkpoint.tar")  # the worker extracts it, with its caps
    assert (tmp_path / "checkpoint.tar").read_bytes() == data


def test_a_gzipped_sharded_archive_brings_its_index_and_shards(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints) -> None:
    sharded = tiny_checkpoints.sharded
    pinned = ModelResolver(settings, store, None).pin(ref(upload(store, tar_of(sharded, gzip=True))),
                                                      weight_digests=True)
    assert pinned.checkpoint is not None and pinned.checkpoint.weights is not None
    assert pinned.checkpoint.weights == {name: sha256_file(sharded / name) for name in (
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")}


def test_archives_nxdi_cannot_compile_are_refused_naming_the_problem(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    resolver = ModelResolver(settings, store, None)
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_checkpoints.base, no_config)
    (no_config / "config.json").unlink()
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoints.base, no_weights)
    (no_weights / "model.safetensors").unlink()
    huge = tmp_path / "huge-config"
    shutil.copytree(tiny_checkpoints.base, huge)
    (huge / "config.json").write_bytes(b" " * (4 * 1024**2 + 1))
    cases = [
        (tar_of(no_config), "the archive has no config.json at its root or in its single top-level directory"),
        (tar_of(no_weights), "no weights beside it: NxD Inference reads one of model.safetensors"),
        (tar_of(huge), "config.json in the archive is larger than 4 MiB"),
        (b"not a tar archive at all", "is not a readable tar archive of a checkpoint directory"),
    ]
    for data, says in cases:
        with pytest.raises(ModelRefError) as raised:
            resolver.pin(ref(upload(store, data)))
        assert raised.value.field == "model.uri"
        assert says in raised.value.message


def test_an_archive_with_more_files_than_the_cap_is_refused(
        tmp_path: Path, store: LocalStore, tiny_checkpoints: Checkpoints) -> None:
    settings = Settings(data_dir=tmp_path / "data", hf_extract_max_files=2)
    with pytest.raises(ModelRefError, match="more than 2 files"):
        ModelResolver(settings, store, None).pin(ref(upload(store, tar_of(tiny_checkpoints.base))))


# -- file:///abs/dir ---------------------------------------------------------------------------------------------


def test_a_directory_is_pinned_file_by_file_and_fetched_verified(
        tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints.base, directory)
    refused = ModelResolver(Settings(data_dir=tmp_path / "data"), None, None)
    with pytest.raises(ModelRefError, match="COMPILESVC_ALLOW_FILE_MODELS"):
        refused.pin(ref(directory.as_uri()))
    resolver = ModelResolver(Settings(data_dir=tmp_path / "data", allow_file_models=True), None, None)
    pinned = resolver.pin(ref(directory.as_uri()), weight_digests=True)
    assert pinned.checkpoint is not None
    assert pinned.checkpoint.config == Checkpoints.config(directory)
    assert pinned.checkpoint.weights == {"model.safetensors": sha256_file(directory / "model.safetensors")}
    assert pinned.fetch["kind"] == "file-dir"
    assert sorted(f["path"] for f in pinned.fetch["files"]) == ["config.json", "generation_config.json",
                                                                "model.safetensors"]
    assert resolver.pin(ref(directory.as_uri())).sha256 == pinned.sha256  # a digest of the pinned list

    resolver.fetch(pinned.fetch, tmp_path / "fetched")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "fetched" / name).read_bytes() == (directory / name).read_bytes()

    st = os.stat(directory / "config.json")
    os.utime(directory / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert resolver.pin(ref(directory.as_uri())).sha256 != pinned.sha256
    with pytest.raises(ModelChangedError, match="changed since it was pinned"):
        resolver.fetch(pinned.fetch, tmp_path / "again")
    with pytest.raises(ModelRefError, match="is not a directory"):
        resolver.pin(ref((directory / "config.json").as_uri()))


# -- s3://bucket/prefix/ (weed) ----------------------------------------------------------------------------------


def put_directory(raw: Any, bucket: str, prefix: str, directory: Path) -> dict[str, str]:
    versions = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            name = path.relative_to(directory).as_posix()
            versions[name] = raw.put_object(Bucket=bucket, Key=prefix + name, Body=path.read_bytes())["VersionId"]
    return versions


def test_a_prefix_is_pinned_object_by_object_by_version(
        s3: S3Server, versioned: str, tmp_path: Path, tiny_checkpoints: Checkpoints,
        sessions: sessionmaker[Session]) -> None:
    raw = s3.raw_client()
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    versions = put_directory(raw, versioned, prefix, tiny_checkpoints.sharded)
    settings = Settings(data_dir=tmp_path / "data", s3_endpoint_url=s3.endpoint_url, s3_region=s3.region)
    resolver = ModelResolver(settings, None, sessions)
    uri = f"s3://{versioned}/{prefix}"
    pinned = resolver.pin(ref(uri))
    assert pinned.checkpoint is not None and pinned.checkpoint.weights is None
    assert pinned.checkpoint.config == Checkpoints.config(tiny_checkpoints.sharded)
    assert pinned.fetch["kind"] == "s3-prefix"
    assert {o["path"]: o["version_id"] for o in pinned.fetch["objects"]} == versions

    with_weights = resolver.pin(ref(uri), weight_digests=True)
    assert with_weights.checkpoint is not None and with_weights.checkpoint.weights == {
        name: sha256_file(tiny_checkpoints.sharded / name) for name in (
            "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")}

    # A new config.json version after the pin: the worker still gets the pinned one, every object verified.
    raw.put_object(Bucket=versioned, Key=prefix + "config.json", Body=b'{"architectures": ["Other"]}')
    resolver.fetch(pinned.fetch, tmp_path / "fetched")
    for name in versions:
        assert (tmp_path / "fetched" / name).read_bytes() == (tiny_checkpoints.sharded / name).read_bytes()
    repinned = resolver.pin(ref(uri))
    assert repinned.sha256 != pinned.sha256
    assert repinned.checkpoint is not None and repinned.checkpoint.config == {"architectures": ["Other"]}


def test_prefix_refusals(s3: S3Server, versioned: str, tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    raw = s3.raw_client()
    settings = Settings(data_dir=tmp_path / "data", s3_endpoint_url=s3.endpoint_url, s3_region=s3.region,
                        hf_extract_max_files=2)
    resolver = ModelResolver(settings, None, None)
    empty = f"s3://{versioned}/nothing-{uuid.uuid4().hex[:8]}/"
    with pytest.raises(ModelRefError, match="holds no objects"):
        resolver.pin(ref(empty))
    prefix = f"many-{uuid.uuid4().hex[:8]}/"
    put_directory(raw, versioned, prefix, tiny_checkpoints.base)
    with pytest.raises(ModelRefError, match="holds more than 2 objects"):
        resolver.pin(ref(f"s3://{versioned}/{prefix}"))
    total = sum(p.stat().st_size for p in tiny_checkpoints.base.rglob("*") if p.is_file())
    capped = ModelResolver(settings.model_copy(update={"hf_extract_max_files": 100, "hf_extract_max_bytes": total - 1}),
                           None, None)
    with pytest.raises(ModelRefError) as too_large:
        capped.pin(ref(f"s3://{versioned}/{prefix}"))
    assert f"holds {total} bytes" in too_large.value.message
    assert "COMPILESVC_HF_EXTRACT_MAX_BYTES" in too_large.value.message
    with pytest.raises(ModelRefError, match="is a prefix holding the checkpoint directory"):
        resolver.pin(ref(f"s3://{versioned}/{prefix}config.json"))


class CountingStore(LocalStore):
    """The local store, counting the blobs opened and the ranges read (what a pin reads from the store)."""

    opened: list[str]

    def open_blob(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        self.opened.append(sha256)
        return super().open_blob(sha256)

    def open_blob_ranged(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        self.opened.append(sha256)
        return super().open_blob_ranged(sha256)

    def read_blob_range(self, sha256: str, offset: int, length: int) -> bytes:
        self.opened.append(sha256)
        return super().read_blob_range(sha256, offset, length)


def test_an_archive_pinned_again_reads_nothing_from_the_store(
        settings: Settings, tmp_path: Path, tiny_checkpoints: Checkpoints, sessions: sessionmaker[Session]) -> None:
    """Its material is remembered by the blob's sha256 (checkpoint_pins): the second pin, in another resolver
    (another process), opens no blob; one asking for weight digests the first did not compute reads it once more,
    and then not again."""
    store = CountingStore(tmp_path / "counted", public_url="http://127.0.0.1:1", secret_key=b"k" * 32)
    store.opened = []
    uri = upload(store, tar_of(tiny_checkpoints.base))
    first = ModelResolver(settings, store, sessions).pin(ref(uri))
    reads = len(store.opened)
    assert reads >= 1
    again = ModelResolver(settings, store, sessions).pin(ref(uri))
    assert again == first and len(store.opened) == reads
    weighed = ModelResolver(settings, store, sessions).pin(ref(uri), weight_digests=True)
    assert len(store.opened) > reads and weighed.checkpoint is not None and weighed.checkpoint.weights
    reads = len(store.opened)
    assert ModelResolver(settings, store, sessions).pin(ref(uri), weight_digests=True) == weighed
    assert ModelResolver(settings, store, sessions).pin(ref(uri)) == first and len(store.opened) == reads


# -- what the key reads is what the compile reads (issue 29 review) ----------------------------------------------


def test_archives_whose_files_could_differ_between_key_and_compile_are_refused_naming_the_member(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints) -> None:
    resolver = ModelResolver(settings, store, None)
    for case, (data, member) in aliasing_archives(tiny_checkpoints.base).items():
        with pytest.raises(ModelRefError) as raised:
            resolver.pin(ref(upload(store, data)), weight_digests=True)
        assert raised.value.field == "model.uri", case
        assert repr(member) in raised.value.message, (case, raised.value.message)


def test_only_the_roots_config_and_index_are_read_whole(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    # An index elsewhere in the archive is not NxDI's: it is neither held nor refused for its size (a 3 MiB upload
    # used to cost a copy of every such file up to one directory deep).
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints.base, directory)
    (directory / "extra").mkdir()
    (directory / "extra" / "model.safetensors.index.json").write_bytes(b" " * (64 * 1024**2 + 1))
    (directory / "extra" / "config.json").write_bytes(b" " * (4 * 1024**2 + 1))
    pinned = ModelResolver(settings, store, None).pin(ref(upload(store, tar_of(directory, gzip=True))))
    assert pinned.checkpoint is not None and pinned.checkpoint.config == Checkpoints.config(directory)


def test_the_weights_hashed_are_the_ones_the_releases_nxdi_reads(
        settings: Settings, store: LocalStore, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    # A diffusers-named file beside an index: NxDI 0.4+ reads it first (NXDI@ef2731e modules/checkpoint.py:L49-L58),
    # NxDI 0.1-0.3 has no such name and reads the index's shards.
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints.sharded, directory)
    shutil.copy(tiny_checkpoints.fine_tune / "model.safetensors", directory / "diffusion_pytorch_model.safetensors")
    uri = upload(store, tar_of(directory))
    resolver = ModelResolver(settings, store, None)
    newest = resolver.pin(ref(uri), weight_digests=True)
    assert newest.checkpoint is not None and newest.checkpoint.weights == {
        "diffusion_pytorch_model.safetensors": sha256_file(directory / "diffusion_pytorch_model.safetensors")}
    old = resolver.pin(ref(uri), weight_digests=True, sdk="2.21.0")
    assert old.checkpoint is not None and old.checkpoint.weights is not None
    assert sorted(old.checkpoint.weights) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                              "model.safetensors.index.json"]


def test_a_directory_larger_than_the_extraction_cap_is_refused(tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints.base, directory)
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    settings = Settings(data_dir=tmp_path / "data", allow_file_models=True, hf_extract_max_bytes=total - 1)
    with pytest.raises(ModelRefError) as raised:
        ModelResolver(settings, None, None).pin(ref(directory.as_uri()))
    assert f"holds {total} bytes" in raised.value.message
    assert "COMPILESVC_HF_EXTRACT_MAX_BYTES" in raised.value.message
    ModelResolver(settings.model_copy(update={"hf_extract_max_bytes": total}), None, None).pin(ref(directory.as_uri()))
