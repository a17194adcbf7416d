"""The artifact store package: :func:`open_store` picks the implementation from ``settings.resolved_store_url``.

``file:///abs/dir`` gives a :class:`LocalStore` (download URLs signed with the service's secret and served
by the API at ``public_url``); ``s3://bucket/prefix`` gives an :class:`S3Store` on
``settings.s3_endpoint_url`` / ``settings.s3_region`` with the standard AWS credential chain. The base
types are re-exported so callers import everything store-related from here. boto3 is imported only when
an S3 store is opened (or ``S3Store`` named): a client that only verifies downloads
(:mod:`compilesvc.store.hashing`) does not pay for it.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path

from compilesvc.config.settings import Settings
from compilesvc.store.base import (
    SHA256_RE,
    ArtifactStore,
    BlobInfo,
    BlobNotFound,
    BlobTooLarge,
    ContentMismatch,
    DigestMismatch,
    IntegrityError,
    SizeMismatch,
    StoreError,
    StoreUnavailable,
    artifact_manifest_name,
    blob_name,
    bucket_manifest_name,
)
from compilesvc.store.local import LocalStore

__all__ = [
    "SHA256_RE",
    "ArtifactStore",
    "BlobInfo",
    "BlobNotFound",
    "BlobTooLarge",
    "ContentMismatch",
    "DigestMismatch",
    "IntegrityError",
    "LocalStore",
    "S3Store",
    "SizeMismatch",
    "StoreError",
    "StoreUnavailable",
    "artifact_manifest_name",
    "blob_name",
    "bucket_manifest_name",
    "open_store",
]


def open_store(settings: Settings) -> ArtifactStore:
    """The store named by ``settings.resolved_store_url``; ValueError for a URL of another kind."""
    url = settings.resolved_store_url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"store_url {url!r}: expected file:///absolute/dir")
        return LocalStore(
            Path(urllib.request.url2pathname(parsed.path)),
            public_url=settings.public_url,
            secret_key=settings.resolved_secret_key,
        )
    if parsed.scheme == "s3":
        if not parsed.netloc or parsed.query or parsed.fragment:
            raise ValueError(f"store_url {url!r}: expected s3://bucket/prefix")
        import boto3

        from compilesvc.store.s3 import S3Store
        from compilesvc.store.s3_client import make_client

        # One session resolves credentials once; both clients share its (refreshing) credentials.
        session = boto3.Session()
        return S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            make_client(settings.s3_endpoint_url, settings.s3_region, session=session),
            # A dedicated client for writes: it carries the If-None-Match handlers.
            create_client=make_client(settings.s3_endpoint_url, settings.s3_region, session=session),
            spool_dir=settings.spool_dir,
        )
    raise ValueError(f"store_url {url!r}: expected file:///abs/dir or s3://bucket/prefix")


def __getattr__(name: str) -> object:
    if name == "S3Store":
        from compilesvc.store.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
