"""Store fixtures: a LocalStore behind a tiny blob-serving HTTP server, and an S3Store on the weed server.

Both come from :func:`compilesvc.store.open_store`, the way the service builds them. The HTTP server is
the contract the API must implement for local-store URLs (verify the signature, stream the file), so the
conformance suite can download through a URL from either store with ``requests``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import botocore.auth
import pytest

from compilesvc.config.settings import Settings
from compilesvc.store import ArtifactStore, LocalStore, S3Store, blob_name, open_store
from compilesvc.store.signing import content_disposition, verify_blob_signature
from tests.fixtures.s3server import S3Server

SECRET = "test-secret-0123456789abcdef"


@dataclass
class StoreCase:
    """A store under test plus backend-specific helpers the conformance suite needs."""

    kind: str
    store: ArtifactStore
    corrupt_blob: Callable[[str, bytes], None]  # replace a stored blob's bytes behind the store's back
    list_names: Callable[[], list[str]]  # every blob/document name stored (relative to the store root)
    # Uploads a crashed writer left behind, made behind the store's back: an S3 multipart upload of a blob
    # key with one part sent, or a partial temp file in the local store's tmp/. Returns its id.
    abandon_upload: Callable[[], str]
    resume_upload: Callable[[str], None]  # more bytes arrive for it (a part, a write): activity
    open_uploads: Callable[[], set[str]]  # ids of the uploads still open (multipart or temp files)
    # URLs signed inside this context are signed as if ``seconds`` ago (so an expiry needs no waiting).
    signed_ago: Callable[[float], AbstractContextManager[None]]


def _random_blob_name() -> str:
    return blob_name(hashlib.sha256(os.urandom(16)).hexdigest())


def _serve_local_blobs(store_ref: list[LocalStore]) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            store = store_ref[0]
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            sha256 = url.path.rsplit("/", 1)[-1]
            try:
                expires = int(query.get("expires", ""))
            except ValueError:
                expires = 0
            filename = query.get("filename")
            if not url.path.startswith("/v1/blobs/") or not verify_blob_signature(
                SECRET.encode(), sha256, expires, filename, query.get("sig", "")
            ):
                self.send_error(403)
                return
            path = store.local_blob_path(sha256)
            if not path.exists():
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            if filename:
                self.send_header("Content-Disposition", content_disposition(filename))
            self.end_headers()
            with open(path, "rb") as src:
                shutil.copyfileobj(src, self.wfile)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # A short poll: shutdown() waits for the serve loop's next poll, 0.5 s by default, at every test's teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Credentials for the weed server through the standard AWS chain (environment variables)."""
    s3_server.use_as_credential_chain(monkeypatch)
    return s3_server


@pytest.fixture
def raw_s3(s3_server: S3Server) -> Any:
    """A plain SigV4 client with no create-only handlers, for poking at the bucket behind a store's back."""
    return s3_server.raw_client()


@pytest.fixture
def isolated_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the process temp dir somewhere we can inspect (S3 spools land there)."""
    directory = tmp_path / "systmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


@pytest.fixture
def local_case(tmp_path: Path) -> Iterator[StoreCase]:
    ref: list[LocalStore] = []
    server, base_url = _serve_local_blobs(ref)
    settings = Settings(
        data_dir=tmp_path / "data",
        store_url=(tmp_path / "artifacts").as_uri(),
        public_url=base_url,
        secret_key=SECRET,
    )
    store = open_store(settings)
    assert isinstance(store, LocalStore)
    ref.append(store)

    def corrupt(sha256: str, data: bytes) -> None:
        path = store.local_blob_path(sha256)
        path.chmod(0o644)
        path.write_bytes(data)

    def names() -> list[str]:
        return sorted(
            str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file() or p.is_symlink()
        )

    def abandon() -> str:
        # What a writer killed mid-upload leaves: a partial file named like the store's own temp files.
        fd, name = tempfile.mkstemp(dir=store.root / "tmp", prefix="w-")
        os.write(fd, b"partial upload")
        os.close(fd)
        return os.path.basename(name)

    def resume(upload: str) -> None:
        with open(store.root / "tmp" / upload, "ab") as handle:
            handle.write(b" more")

    def open_uploads() -> set[str]:
        return {p.name for p in (store.root / "tmp").iterdir()}

    try:
        @contextlib.contextmanager
        def signed_ago(seconds: float) -> Iterator[None]:
            store.clock = lambda: time.time() - seconds
            try:
                yield
            finally:
                store.clock = None

        yield StoreCase("local", store, corrupt, names, abandon, resume, open_uploads, signed_ago)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def shared_bucket(s3_server: S3Server) -> str:
    """One bucket for the S3 store tests; each test gets its own prefix (creating buckets is slow)."""
    return s3_server.new_bucket("store")


def unique_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}/deep"


@pytest.fixture
def s3_case(s3_env: S3Server, raw_s3: Any, shared_bucket: str, tmp_path: Path) -> StoreCase:
    prefix = unique_prefix()
    settings = Settings(data_dir=tmp_path / "data", store_url=f"s3://{shared_bucket}/{prefix}",
                        s3_endpoint_url=s3_env.endpoint_url, s3_region=s3_env.region)
    store = open_store(settings)
    assert isinstance(store, S3Store)

    def corrupt(sha256: str, data: bytes) -> None:
        raw_s3.put_object(Bucket=shared_bucket, Key=f"{prefix}/{blob_name(sha256)}", Body=data)

    def names() -> list[str]:
        listing = raw_s3.list_objects_v2(Bucket=shared_bucket, Prefix=f"{prefix}/")
        return sorted(obj["Key"].removeprefix(f"{prefix}/") for obj in listing.get("Contents", []))

    keys: dict[str, str] = {}
    parts: dict[str, int] = {}

    def abandon() -> str:
        # What an API killed mid-upload (or one whose abort failed while S3 was down) leaves behind.
        key = f"{prefix}/{_random_blob_name()}"
        upload = raw_s3.create_multipart_upload(Bucket=shared_bucket, Key=key)["UploadId"]
        keys[upload] = key
        resume(upload)
        return str(upload)

    def resume(upload: str) -> None:
        parts[upload] = parts.get(upload, 0) + 1
        raw_s3.upload_part(Bucket=shared_bucket, Key=keys[upload], UploadId=upload, PartNumber=parts[upload],
                           Body=b"part of a model")

    def open_uploads() -> set[str]:
        listing = raw_s3.list_multipart_uploads(Bucket=shared_bucket, Prefix=f"{prefix}/")
        return {u["UploadId"] for u in listing.get("Uploads", [])}

    return StoreCase("s3", store, corrupt, names, abandon, resume, open_uploads, _botocore_signed_ago)


@contextlib.contextmanager
def _botocore_signed_ago(seconds: float) -> Iterator[None]:
    """SigV4 presigning reads botocore.auth.get_current_datetime (botocore 1.3x); the server judges expiry by
    its own clock, so a URL signed "earlier" is one whose window ended for real."""
    real = botocore.auth.get_current_datetime
    botocore.auth.get_current_datetime = lambda *a, **k: real(*a, **k) - timedelta(seconds=seconds)
    try:
        yield
    finally:
        botocore.auth.get_current_datetime = real


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def case(request: pytest.FixtureRequest) -> StoreCase:
    """The conformance suite runs every test on both stores."""
    return request.getfixturevalue(f"{request.param}_case")  # type: ignore[no-any-return]
