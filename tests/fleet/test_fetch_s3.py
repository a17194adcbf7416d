"""The fleet cache against the real S3 server: presigned GETs answer ranges, so a download an earlier
process left half-done continues where it stopped; a partial file that is not a prefix of the blob is
caught by the sha256 and the download starts over."""

from __future__ import annotations

import hashlib
import random

from tests.fleet.conftest import FleetApi

MIB = 1024 * 1024


def test_s3_downloads_resume_with_a_range(fleet_api_s3: FleetApi) -> None:
    api = fleet_api_s3
    size = 3 * MIB
    key = api.publish(buckets=((1, 8),), size=size)
    bucket = api.manifest(key)["buckets"][0]
    entry = bucket["files"][0]
    assert entry["url"].startswith(api.env.services.settings.s3_endpoint_url or "http")
    content = random.Random(bucket["key"]).randbytes(size)
    assert hashlib.sha256(content).hexdigest() == entry["sha256"]

    partial = api.cache / "v1" / "partial" / f"{entry['sha256']}.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(content[: MIB + 17])  # what a killed fetch leaves
    report = api.fetch_json(key)
    assert report["resumed"] == {"bucket-0/model.pt": MIB + 17}
    assert report["received_bytes"] == size - MIB - 17

    # A partial file that is not the blob's prefix: the hash catches it, one clean download follows.
    other = api.publish(buckets=((2, 8),), size=size)
    other_entry = api.manifest(other)["buckets"][0]["files"][0]
    bad = api.cache / "v1" / "partial" / f"{other_entry['sha256']}.part"
    bad.write_bytes(b"\0" * MIB)
    report = api.fetch_json(other)
    assert report["received_bytes"] == size + (size - MIB)  # the resumed tail, then the whole file
    path = api.cache / "v1" / "artifacts" / other / "bucket-0" / "model.pt"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == other_entry["sha256"]
