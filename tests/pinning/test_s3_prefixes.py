"""What pinning an S3 prefix costs, counted on the service's own S3 client against weed (the real S3 server): one
ListObjectVersions pass, HEADs only of the weight files when their digests are needed, config.json and the index
read once per version (remembered in the ledger), and the slow path (ListObjectsV2 and a HEAD per object) only
when the bucket denies ListBucketVersions."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelRefError, PinnedModel
from compilesvc.spec.compile_spec import ModelRef
from tests.fixtures.checkpoints import Checkpoints, sha256_file
from tests.fixtures.s3server import S3Server

SHARDED_WEIGHTS = ("model.safetensors.index.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors")


def ref(uri: str) -> ModelRef:
    return ModelRef(uri=uri, format="hf-checkpoint")


def put_directory(raw: Any, bucket: str, prefix: str, directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            raw.put_object(Bucket=bucket, Key=prefix + path.relative_to(directory).as_posix(), Body=path.read_bytes())


class Counted:
    """A resolver (another process, as far as the ledger knows) whose S3 client counts the calls it makes, by
    operation and by (operation, key)."""

    def __init__(self, s3: S3Server, tmp_path: Path, sessions: sessionmaker[Session] | None):
        settings = Settings(data_dir=tmp_path / "data", s3_endpoint_url=s3.endpoint_url, s3_region=s3.region)
        self.resolver = ModelResolver(settings, None, sessions)
        self.calls: Counter[str] = Counter()
        self.keys: Counter[tuple[str, str]] = Counter()
        self.resolver.s3_client.meta.events.register("before-parameter-build.s3", self._count)

    def _count(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        self.calls[model.name] += 1
        if "Key" in params:
            self.keys[(model.name, str(params["Key"]).rsplit("/", 1)[-1])] += 1

    def pin(self, uri: str, **kwargs: Any) -> PinnedModel:
        self.calls.clear()
        self.keys.clear()
        return self.resolver.pin(ref(uri), **kwargs)


def test_a_prefix_is_listed_once_and_only_its_weights_headed_when_their_digests_are_needed(
        s3: S3Server, versioned: str, tmp_path: Path, tiny_checkpoints: Checkpoints,
        sessions: sessionmaker[Session]) -> None:
    sharded = tiny_checkpoints.sharded
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    put_directory(s3.raw_client(), versioned, prefix, sharded)
    uri = f"s3://{versioned}/{prefix}"

    first = Counted(s3, tmp_path, sessions)
    pinned = first.pin(uri)
    assert first.calls == {"ListObjectVersions": 1, "GetObject": 2}  # config.json and the index, no HEAD
    assert first.keys == {("GetObject", "config.json"): 1, ("GetObject", "model.safetensors.index.json"): 1}
    assert pinned.checkpoint is not None and pinned.checkpoint.config == Checkpoints.config(sharded)
    assert all(o["version_id"] and o["etag"].startswith('"') for o in pinned.fetch["objects"])

    weighed = first.pin(uri, weight_digests=True)
    # One HEAD per weight file (its S3 checksum); weed keeps none, so each is hashed once and remembered.
    assert first.calls["HeadObject"] == 3 and {key for op, key in first.keys if op == "HeadObject"} == set(
        SHARDED_WEIGHTS)
    assert {key for op, key in first.keys if op == "GetObject"} == set(SHARDED_WEIGHTS)
    assert weighed.checkpoint is not None and weighed.checkpoint.weights == {
        name: sha256_file(sharded / name) for name in SHARDED_WEIGHTS}

    # Another process: its listing and one ledger read, no GET; the weights' digests are remembered too.
    second = Counted(s3, tmp_path, sessions)
    assert second.pin(uri) == pinned and second.calls == {"ListObjectVersions": 1}
    assert second.pin(uri, weight_digests=True) == weighed
    assert second.calls == {"ListObjectVersions": 1, "HeadObject": 3}

    second.resolver.fetch(pinned.fetch, tmp_path / "fetched")  # what the worker's fetch_prefix reads
    for name in SHARDED_WEIGHTS:
        assert (tmp_path / "fetched" / name).read_bytes() == (sharded / name).read_bytes()


def test_a_new_config_version_is_read_again_and_a_shard_gone_is_refused_though_the_index_is_remembered(
        s3: S3Server, versioned: str, tmp_path: Path, tiny_checkpoints: Checkpoints,
        sessions: sessionmaker[Session]) -> None:
    raw = s3.raw_client()
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    put_directory(raw, versioned, prefix, tiny_checkpoints.sharded)
    uri = f"s3://{versioned}/{prefix}"
    counted = Counted(s3, tmp_path, sessions)
    pinned = counted.pin(uri)

    raw.put_object(Bucket=versioned, Key=prefix + "config.json", Body=b'{"architectures": ["Other"]}')
    repinned = counted.pin(uri)
    assert counted.keys == {("GetObject", "config.json"): 1, ("GetObject", "model.safetensors.index.json"): 1}
    assert repinned.checkpoint is not None and repinned.checkpoint.config == {"architectures": ["Other"]}
    assert repinned.sha256 != pinned.sha256

    raw.delete_object(Bucket=versioned, Key=prefix + "model-00002-of-00002.safetensors")  # a delete marker
    with pytest.raises(ModelRefError, match="names shards the checkpoint lacks: model-00002-of-00002"):
        counted.pin(uri)
    assert counted.calls == {"ListObjectVersions": 1}  # the index was remembered, the listing lacks its shard


def test_an_unversioned_prefix_is_pinned_by_etag_and_skips_directory_markers(
        s3: S3Server, tmp_path: Path, tiny_checkpoints: Checkpoints, sessions: sessionmaker[Session]) -> None:
    raw = s3.raw_client()
    bucket = s3.new_bucket("plain")
    prefix = "llama/"
    put_directory(raw, bucket, prefix, tiny_checkpoints.base)
    raw.put_object(Bucket=bucket, Key=prefix + "empty-dir/", Body=b"")
    counted = Counted(s3, tmp_path, sessions)
    pinned = counted.pin(f"s3://{bucket}/{prefix}", weight_digests=True)
    assert sorted(o["path"] for o in pinned.fetch["objects"]) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    assert all(o["version_id"] is None for o in pinned.fetch["objects"])  # "null" in the listing
    assert counted.keys[("HeadObject", "model.safetensors")] == 1 and counted.calls["HeadObject"] == 1
    counted.resolver.fetch(pinned.fetch, tmp_path / "fetched")
    assert (tmp_path / "fetched" / "model.safetensors").read_bytes() == (
        tiny_checkpoints.base / "model.safetensors").read_bytes()


def deny_list_bucket_versions(resolver: ModelResolver) -> None:
    """The bucket's policy grants s3:ListBucket but not s3:ListBucketVersions: S3 answers ListObjectVersions with
    403 AccessDenied. weed's identities cannot tell the two list permissions apart, so the 403 is S3's answer
    given at botocore's own hook, before the request leaves."""
    def refuse(**_: Any) -> tuple[AWSResponse, dict[str, Any]]:
        response = AWSResponse("https://s3.invalid", 403, {}, None)  # type: ignore[arg-type]
        return response, {"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}

    resolver.s3_client.meta.events.register("before-call.s3.ListObjectVersions", refuse)


def test_a_bucket_denying_list_bucket_versions_is_listed_and_headed_object_by_object(
        s3: S3Server, versioned: str, tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    put_directory(s3.raw_client(), versioned, prefix, tiny_checkpoints.sharded)
    uri = f"s3://{versioned}/{prefix}"
    listed = Counted(s3, tmp_path, None).pin(uri)
    counted = Counted(s3, tmp_path, None)
    deny_list_bucket_versions(counted.resolver)
    pinned = counted.pin(uri)
    objects = len(pinned.fetch["objects"])
    assert counted.calls == {"ListObjectVersions": 1, "ListObjectsV2": 1, "HeadObject": objects, "GetObject": 2}
    assert pinned == listed  # the same pin, whichever way the prefix was listed

    settings = Settings(data_dir=tmp_path / "data", s3_endpoint_url=s3.endpoint_url, s3_region=s3.region,
                        hf_extract_max_files=2)
    capped = ModelResolver(settings, None, None)
    deny_list_bucket_versions(capped)
    with pytest.raises(ModelRefError, match="holds more than 2 objects"):
        capped.pin(ref(uri))
