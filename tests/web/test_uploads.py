"""POST /v1/models (streamed uploads and their limit) and GET /v1/blobs/{sha256} (signed local-store URLs)."""

from __future__ import annotations

import hashlib
import io
import time
import urllib.parse

import pytest
from werkzeug.test import EnvironBuilder, TestResponse
from werkzeug.wrappers import Request

from compilesvc.store.local import LocalStore
from compilesvc.store.signing import sign_blob_url
from tests.web.support import PUBLIC_URL, Env
from tests.web.test_submit import assert_problem
from web.schemas import UploadOut


class CountingStream(io.RawIOBase):
    """A body that is produced as it is read, so a test can tell how much the server consumed."""

    def __init__(self, size: int, chunk: bytes = b"m" * 65536):
        self.remaining = size
        self.chunk = chunk
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        n = min(len(buffer), self.remaining, len(self.chunk))
        buffer[:n] = self.chunk[:n]
        self.remaining -= n
        self.consumed += n
        return n


def post_stream(env: Env, stream: io.RawIOBase, content_length: int | None,
                content_type: str | None = "application/octet-stream") -> TestResponse:
    """POST a non-seekable body the way a WSGI server passes it: with a Content-Length, or chunked
    (no length, ``wsgi.input_terminated`` set, as gunicorn does). Werkzeug's test client would seek."""
    environ = EnvironBuilder(path="/v1/models", method="POST", content_type=content_type).get_environ()
    environ["wsgi.input"] = io.BufferedReader(stream)
    if content_length is None:
        environ.pop("CONTENT_LENGTH", None)
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = str(content_length)
    return env.client.open(Request(environ))


def test_upload_streams_into_the_store(sqlite_env: Env) -> None:
    env = sqlite_env
    size = 3 * 1024 * 1024 + 17
    stream = CountingStream(size)
    response = post_stream(env, stream, size)
    assert response.status_code == 201
    body = UploadOut.model_validate(response.json)
    expected = hashlib.sha256(b"".join([b"m" * 65536] * (size // 65536) + [b"m" * (size % 65536)])).hexdigest()
    assert body.sha256 == expected and body.size == size and body.created
    assert body.uri == f"blob:sha256:{expected}"
    assert env.services.store.blob_size(expected) == size
    again = env.client.post("/v1/models", data=b"m" * 10)
    assert again.status_code == 201
    assert env.client.post("/v1/models", data=b"m" * 10).json["created"] is False


def test_upload_limit(make_env, sqlite_url: str) -> None:  # type: ignore[no-untyped-def]
    env = make_env(sqlite_url, max_upload_bytes=100_000, max_request_bytes=4096)
    # Over the general request limit but within the upload limit: accepted.
    assert env.client.post("/v1/models", data=b"x" * 50_000).status_code == 201
    # Declared too large: refused before reading the body.
    stream = CountingStream(200_000)
    refused = post_stream(env, stream, 200_000)
    body = assert_problem(refused, 413, "upload-too-large")
    assert body["max_bytes"] == 100_000
    assert stream.consumed == 0
    # No length (chunked): cut off once past the limit, not read to the end.
    endless = CountingStream(10_000_000)
    cut = post_stream(env, endless, None)
    assert_problem(cut, 413, "upload-too-large")
    assert endless.consumed < 1_000_000
    assert_problem(env.client.post("/v1/models", data=b""), 400, "invalid-request")
    chunked_ok = post_stream(env, CountingStream(60_000), None)
    assert chunked_ok.status_code == 201 and chunked_ok.json["size"] == 60_000


@pytest.mark.parametrize("content_type", [
    "multipart/form-data; boundary=xyz",
    "Multipart/Form-Data; boundary=xyz",
    "multipart/mixed; boundary=xyz",
    "application/x-www-form-urlencoded",
    "application/x-www-form-urlencoded; charset=utf-8",
])
def test_form_uploads_are_refused_before_reading(sqlite_env: Env, content_type: str) -> None:
    stream = CountingStream(200_000)
    refused = post_stream(sqlite_env, stream, 200_000, content_type)
    body = assert_problem(refused, 415, "unsupported-media-type")
    assert "--data-binary @model.pt" in body["detail"] and "application/octet-stream" in body["hint"]
    assert refused.headers["Accept-Post"] == "application/octet-stream"
    assert stream.consumed == 0  # refused before a byte of the body was read: nothing can be stored


def test_curl_f_upload_stores_nothing(sqlite_env: Env) -> None:
    env = sqlite_env
    model = b"a torchscript model" * 100
    form = env.client.post("/v1/models", data={"file": (io.BytesIO(model), "model.pt")})
    assert form.request.mimetype == "multipart/form-data"
    assert_problem(form, 415, "unsupported-media-type")
    raw_form = form.request.get_data()
    store = env.services.store
    assert isinstance(store, LocalStore)
    assert not store.has_blob(hashlib.sha256(model).hexdigest())
    assert not store.has_blob(hashlib.sha256(raw_form).hexdigest())
    assert [p for p in store.root.rglob("*") if p.is_file()] == []
    # The same bytes as a raw body are the model.
    raw = env.client.post("/v1/models", data=model, content_type="application/octet-stream")
    assert raw.status_code == 201 and raw.json["sha256"] == hashlib.sha256(model).hexdigest()


@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "application/zip"])
def test_raw_bodies_are_accepted_with_or_without_a_type(sqlite_env: Env, content_type: str | None) -> None:
    # No Content-Type: what requests.post(url, data=f) sends; compilesvc upload sends octet-stream.
    response = post_stream(sqlite_env, CountingStream(1000), 1000, content_type)
    assert response.status_code == 201, response.get_data(as_text=True)
    assert response.json["size"] == 1000


def _signed(env: Env, sha256: str, filename: str | None = "model.pt", expires_in: int = 60) -> str:
    store = env.services.store
    assert isinstance(store, LocalStore)
    return store.blob_url(sha256, expires_in=expires_in, filename=filename).removeprefix(PUBLIC_URL)


def test_blob_download_checks_signature_and_expiry(sqlite_env: Env) -> None:
    env = sqlite_env
    data = bytes(range(256)) * 40
    sha = env.client.post("/v1/models", data=data).json["sha256"]
    url = _signed(env, sha)
    ok = env.client.get(url)
    assert ok.status_code == 200 and ok.data == data
    assert ok.mimetype == "application/octet-stream"
    assert ok.headers["ETag"].strip('"') == sha
    ranged = env.client.get(url, headers={"Range": "bytes=10-19"})
    assert ranged.status_code == 206 and ranged.data == data[10:20]
    assert env.client.get(_signed(env, sha, filename=None)).status_code == 200

    path, _, query = url.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    tampered = {**params, "filename": "other.pt"}
    assert_problem(env.client.get(f"{path}?{urllib.parse.urlencode(tampered)}"), 403, "signature-invalid")
    bad_sig = {**params, "sig": "0" * 64}
    assert_problem(env.client.get(f"{path}?{urllib.parse.urlencode(bad_sig)}"), 403, "signature-invalid")
    assert_problem(env.client.get(path), 403, "signature-invalid")
    assert_problem(env.client.get(f"{path}?expires=abc&sig=x"), 403, "signature-invalid")

    # A correctly signed URL whose time is up.
    expires = int(time.time()) - 1
    sig = sign_blob_url(env.settings.resolved_secret_key, sha, expires, "model.pt")
    expired = f"{path}?expires={expires}&sig={sig}&filename=model.pt"
    assert_problem(env.client.get(expired), 403, "signature-invalid")

    unknown = "e" * 64
    assert_problem(env.client.get(_signed(env, unknown)), 404, "blob-not-found")
    assert_problem(env.client.get("/v1/blobs/NOT-A-SHA?expires=1&sig=x"), 404)
