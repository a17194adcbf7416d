"""Create the artifact bucket (and any other s3:// buckets named) once, then exit: the compose `s3-init` job.

Reads the same settings as every compilesvc process: the bucket from ``COMPILESVC_STORE_URL``
(``s3://bucket/prefix``), the server from ``COMPILESVC_S3_ENDPOINT_URL`` (unset for AWS S3) and
``COMPILESVC_S3_REGION``, credentials from the standard ``AWS_*`` variables. Extra ``s3://bucket/prefix``
arguments get their buckets created too.

Idempotent: an existing bucket is left as it is. Each bucket gets a lifecycle rule that aborts multipart
uploads left incomplete for a day, unless it already has one; a server that does not implement lifecycle
configuration only earns a warning. The relay's upload sweep (``ArtifactStore.sweep_incomplete_uploads``)
is what aborts uploads a crashed or cut-off writer left open; this rule is the second line of defence.
Exit 0 when every bucket exists, 1 otherwise. Waits up to ``--wait`` seconds for the server to answer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

RULE_ID = "compilesvc-abort-incomplete-multipart"
ABORT_AFTER_DAYS = 1


def bucket_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"expected s3://bucket[/prefix], got {url!r}")
    return parts.netloc


def make_client() -> Any:
    endpoint = os.environ.get("COMPILESVC_S3_ENDPOINT_URL") or None
    region = os.environ.get("COMPILESVC_S3_REGION") or "us-east-1"
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"} if endpoint else {},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


def wait_for_server(client: Any, deadline: float) -> None:
    while True:
        try:
            client.list_buckets()
            return
        except ClientError as exc:
            # 4xx: the server answered and refused (credentials, permissions): waiting will not help.
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500) < 500:
                raise
            if time.monotonic() > deadline:
                raise
        except BotoCoreError:  # not listening yet, connection reset while it starts
            if time.monotonic() > deadline:
                raise
        time.sleep(1)


def ensure_bucket(client: Any, bucket: str, region: str) -> None:
    try:
        client.head_bucket(Bucket=bucket)
        print(f"s3-init: bucket {bucket} exists")
        return
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    kwargs: dict[str, object] = {"Bucket": bucket}
    if region != "us-east-1" and not os.environ.get("COMPILESVC_S3_ENDPOINT_URL"):
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(**kwargs)
        print(f"s3-init: created bucket {bucket}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
            raise
        print(f"s3-init: bucket {bucket} exists")


def ensure_abort_rule(client: Any, bucket: str) -> None:
    try:
        rules = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code == "NoSuchLifecycleConfiguration":
            rules = []
        elif code in ("NotImplemented", "MethodNotAllowed", "AccessDenied"):
            print(f"s3-init: warning: cannot read lifecycle rules of {bucket} ({code}); skipped", file=sys.stderr)
            return
        else:
            raise
    if any("AbortIncompleteMultipartUpload" in rule and rule.get("Status") == "Enabled" for rule in rules):
        print(f"s3-init: bucket {bucket} already aborts incomplete multipart uploads")
        return
    rules.append(
        {
            "ID": RULE_ID,
            "Status": "Enabled",
            "Filter": {"Prefix": ""},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_AFTER_DAYS},
        }
    )
    try:
        client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
        print(f"s3-init: bucket {bucket} aborts multipart uploads incomplete after {ABORT_AFTER_DAYS} day")
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        print(f"s3-init: warning: lifecycle rule not set on {bucket} ({code}: "
              f"{exc.response.get('Error', {}).get('Message', '')})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="*", metavar="S3_URL", help="more s3://bucket[/prefix] to create")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the server (120)")
    args = parser.parse_args(argv)

    urls = [u for u in [os.environ.get("COMPILESVC_STORE_URL", ""), *args.urls] if u]
    s3_urls = [u for u in urls if u.startswith("s3://")]
    if not s3_urls:
        print("s3-init: COMPILESVC_STORE_URL is not s3://…; nothing to do")
        return 0
    try:
        buckets = list(dict.fromkeys(bucket_of(u) for u in s3_urls))
    except ValueError as exc:
        print(f"s3-init: {exc}", file=sys.stderr)
        return 2
    client = make_client()
    region = os.environ.get("COMPILESVC_S3_REGION") or "us-east-1"
    try:
        wait_for_server(client, time.monotonic() + args.wait)
        for bucket in buckets:
            ensure_bucket(client, bucket, region)
            ensure_abort_rule(client, bucket)
    except (ClientError, BotoCoreError) as exc:
        print(f"s3-init: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
