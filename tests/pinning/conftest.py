"""What the pinning tests share: the S3 server (weed) as the credential chain a resolver finds, and a versioned
bucket per module."""

from __future__ import annotations

import pytest

from tests.fixtures.s3server import S3Server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    s3_server.use_as_credential_chain(monkeypatch)
    return s3_server


@pytest.fixture(scope="module")
def versioned(s3_server: S3Server) -> str:
    bucket = s3_server.new_bucket("ckpt")
    s3_server.raw_client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return bucket
