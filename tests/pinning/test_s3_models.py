"""The compose stack's S3 identities (docker/seaweedfs/identities.sh), proved against a real ``weed mini``
serving exactly the config that script writes: each service may do what it does and nothing more: no
service but s3-init's admin creates buckets or sets their lifecycle, the API never writes a compile's
results (bucket manifests), and nobody writes outside the store's prefix."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.fixtures.s3server import ACCESS_KEY, SECRET_KEY, WeedProcess

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "seaweedfs" / "identities.sh"
BUCKET, PREFIX = "compilesvc", "artifacts"
KEYS = {
    "api": ("api-key", "api-secret-0123456789"),
    "worker": ("worker-key", "worker-secret-0123456789"),
    "relay": ("relay-key", "relay-secret-0123456789"),
}


def write_config(path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "S3_ACCESS_KEY": ACCESS_KEY, "S3_SECRET_KEY": SECRET_KEY,
           "S3_BUCKET": BUCKET, "S3_PREFIX": PREFIX, **extra}
    for name, (access, secret) in KEYS.items():
        env.setdefault(f"S3_{name.upper()}_ACCESS_KEY", access)
        env.setdefault(f"S3_{name.upper()}_SECRET_KEY", secret)
    return subprocess.run(["sh", str(SCRIPT), str(path)], env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("weed-identities")
    done = write_config(workdir / "identities.json")
    assert done.returncode == 0, done.stderr
    process = WeedProcess(workdir, (workdir / "identities.json").read_text())
    server = process.start()
    try:
        admin = client(server.endpoint_url, ACCESS_KEY, SECRET_KEY)
        admin.create_bucket(Bucket=BUCKET)
        admin.create_bucket(Bucket="other")
        yield server.endpoint_url
    finally:
        process.kill()


def client(endpoint: str, access: str, secret: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                      signature_version="s3v4"))


def allowed(call: Callable[[], Any]) -> bool:
    try:
        call()
        return True
    except ClientError as exc:
        assert exc.response["Error"]["Code"] in ("AccessDenied", "403"), exc.response
        return False


def key(where: str) -> str:
    return f"{PREFIX}/{where}/{uuid.uuid4().hex}"


#: (what, the call on a client) -> which services may.
def operations(s3: Any) -> dict[str, Callable[[], Any]]:
    return {
        "put blob": lambda: s3.put_object(Bucket=BUCKET, Key=key("blobs/sha256/ab"), Body=b"x"),
        "put artifact manifest": lambda: s3.put_object(Bucket=BUCKET, Key=key("artifacts"), Body=b"{}"),
        "put bucket manifest": lambda: s3.put_object(Bucket=BUCKET, Key=key("buckets"), Body=b"{}"),
        "put outside the prefix": lambda: s3.put_object(Bucket=BUCKET, Key=f"elsewhere/{uuid.uuid4().hex}",
                                                       Body=b"x"),
        "put in another bucket": lambda: s3.put_object(Bucket="other", Key=key("blobs"), Body=b"x"),
        "multipart upload of a blob": lambda: s3.abort_multipart_upload(
            Bucket=BUCKET, Key=(k := key("blobs/sha256/cd")),
            UploadId=s3.create_multipart_upload(Bucket=BUCKET, Key=k)["UploadId"]),
        "list the store": lambda: s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/"),
        "create a bucket": lambda: s3.create_bucket(Bucket=f"b-{uuid.uuid4().hex[:10]}"),
        "delete a bucket": lambda: s3.delete_bucket(Bucket="other"),
        "set the lifecycle": lambda: s3.put_bucket_lifecycle_configuration(Bucket=BUCKET, LifecycleConfiguration={
            "Rules": [{"ID": "x", "Status": "Enabled", "Filter": {"Prefix": ""},
                       "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}]}),
    }


EXPECTED = {
    "api": {"put blob", "put artifact manifest", "multipart upload of a blob", "list the store"},
    "worker": {"put blob", "put artifact manifest", "put bucket manifest", "multipart upload of a blob",
               "list the store"},
    "relay": {"put blob", "put artifact manifest", "multipart upload of a blob", "list the store"},
}


@pytest.mark.parametrize("service", sorted(KEYS))
def test_each_service_may_do_what_it_does_and_nothing_more(weed: str, service: str) -> None:
    s3 = client(weed, *KEYS[service])
    may = {what for what, call in operations(s3).items() if allowed(call)}
    assert may == EXPECTED[service]


@pytest.mark.parametrize("service", sorted(KEYS))
def test_every_service_reads_the_store(weed: str, service: str) -> None:
    admin = client(weed, ACCESS_KEY, SECRET_KEY)
    name = key("buckets")
    admin.put_object(Bucket=BUCKET, Key=name, Body=b"manifest")
    s3 = client(weed, *KEYS[service])
    assert s3.get_object(Bucket=BUCKET, Key=name)["Body"].read() == b"manifest"
    assert s3.head_object(Bucket=BUCKET, Key=name)["ContentLength"] == len(b"manifest")
    # A presigned download (the API hands these to fleets) works with the API's identity.
    url = s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": name}, ExpiresIn=60)
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.read() == b"manifest"


def test_the_admin_identity_administers(weed: str) -> None:
    s3 = client(weed, ACCESS_KEY, SECRET_KEY)
    may = {what for what, call in operations(s3).items() if allowed(call)}
    assert may == set(operations(s3))


def test_unknown_keys_are_refused(weed: str) -> None:
    with pytest.raises(ClientError):
        client(weed, "nobody", "nobody-secret-0123456789").list_objects_v2(Bucket=BUCKET)


def test_the_script_refuses_bad_keys_and_skips_unset_services(tmp_path: Path) -> None:
    short = write_config(tmp_path / "a.json", S3_API_SECRET_KEY="short")
    assert short.returncode == 2 and "api: the S3 secret key must be at least 16" in short.stderr
    quote = write_config(tmp_path / "b.json", S3_WORKER_ACCESS_KEY='x"y')
    assert quote.returncode == 2 and "worker" in quote.stderr
    alone = write_config(tmp_path / "c.json", S3_RELAY_ACCESS_KEY="", S3_RELAY_SECRET_KEY="")
    assert alone.returncode == 0
    names = [i["name"] for i in json.loads((tmp_path / "c.json").read_text())["identities"]]
    assert names == ["admin", "api", "worker"]


def store_as(endpoint: str, service: str, tmp_path: Path) -> Any:
    """compilesvc's own S3 store, as the service would open it (its keys, the compose store URL)."""
    from compilesvc.store.s3 import S3Store
    from compilesvc.store.s3_client import make_client

    session = boto3.Session(aws_access_key_id=KEYS[service][0], aws_secret_access_key=KEYS[service][1])
    return S3Store(BUCKET, PREFIX, make_client(endpoint, "us-east-1", session=session),
                   create_client=make_client(endpoint, "us-east-1", session=session), spool_dir=tmp_path)


def test_compilesvc_store_works_as_each_service_within_its_rights(weed: str, tmp_path: Path) -> None:
    from compilesvc.store import StoreError, artifact_manifest_name, bucket_manifest_name

    api, worker, relay = (store_as(weed, name, tmp_path) for name in ("api", "worker", "relay"))
    for store in (api, worker, relay):
        store.check()  # readiness (HEAD bucket)
    # The API stores an upload and may publish an artifact manifest, never a bucket's.
    upload = tmp_path / "model.pt"
    upload.write_bytes(b"an uploaded model " + uuid.uuid4().bytes)
    blob = api.put_file(upload)
    assert worker.has_blob(blob.sha256) and relay.blob_size(blob.sha256) == blob.size
    name = uuid.uuid4().hex
    assert api.create_document(artifact_manifest_name(name), b"{}")
    with pytest.raises(StoreError):
        api.create_document(bucket_manifest_name(name), b"{}")
    # The worker publishes a bucket manifest; the relay sweeps abandoned uploads.
    assert worker.create_document(bucket_manifest_name(name), b"{}")
    assert api.read_document(bucket_manifest_name(name)) == b"{}"
    from datetime import timedelta

    assert relay.sweep_incomplete_uploads(timedelta(0)) >= 0
    with pytest.raises(StoreError):
        relay.create_document(bucket_manifest_name(uuid.uuid4().hex), b"{}")
