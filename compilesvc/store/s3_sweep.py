"""Aborting the multipart uploads an S3 store began and nobody finished.

s3transfer aborts a multipart upload that fails, but that abort is itself a request: while S3 is down
it fails too, and a process killed mid-upload never sends one. Such uploads keep their parts (billed,
invisible to readers) until someone aborts them. :func:`abort_abandoned_uploads` is that someone; the
relay runs it periodically through :meth:`compilesvc.store.s3.S3Store.sweep_incomplete_uploads`.

What counts as abandoned: no activity for ``older_than``, judged by the *server's* clock (the ``Date``
of its own answer, so a skewed host clock cannot make a live upload look old). Activity is the upload's
``Initiated`` time and the ``LastModified`` of its newest part: an upload that is still sending parts
is left alone however long ago it started, so the threshold bounds a pause, not an upload's length.
Only keys under the given prefix are looked at: the store's own blobs, never another tenant's uploads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

_GONE_CODES = frozenset({"NoSuchUpload", "404", "NotFound"})


def server_time(response: Mapping[str, Any]) -> datetime:
    """The time the server answered, from its ``Date`` header; this host's clock when it sent none."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        try:
            parsed = parsedate_to_datetime(date)
        except (TypeError, ValueError):
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return parsed
    return datetime.now(UTC)


def _last_part_time(client: S3Client, bucket: str, key: str, upload_id: str) -> datetime | None:
    newest: datetime | None = None
    paginator = client.get_paginator("list_parts")
    for page in paginator.paginate(Bucket=bucket, Key=key, UploadId=upload_id):
        for part in page.get("Parts", []):
            modified = part.get("LastModified")
            if modified is not None and (newest is None or modified > newest):
                newest = modified
    return newest


def abort_abandoned_uploads(client: S3Client, bucket: str, prefix: str, older_than: timedelta) -> int:
    """Abort the multipart uploads under ``prefix`` idle for longer than ``older_than``; how many.

    Botocore errors propagate (the caller classifies them); an upload that vanished meanwhile (another
    sweeper, or its owner completing it) is not an error.
    """
    aborted = 0
    paginator = client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        cutoff = server_time(page) - older_than
        for upload in page.get("Uploads", []):
            key, upload_id, initiated = upload.get("Key"), upload.get("UploadId"), upload.get("Initiated")
            if not key or not upload_id or not key.startswith(prefix):
                continue
            if initiated is None or initiated >= cutoff:
                continue
            try:
                last_part = _last_part_time(client, bucket, key, upload_id)
                if last_part is not None and last_part >= cutoff:
                    continue  # still receiving parts: a long upload, not an abandoned one
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _GONE_CODES:
                    continue
                raise
            log.info("aborted an abandoned multipart upload",
                     extra={"key": key, "upload_id": upload_id, "initiated": initiated.isoformat()})
            aborted += 1
    return aborted


__all__ = ["abort_abandoned_uploads", "server_time"]
