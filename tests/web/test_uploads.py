"""POST /v1/models (streamed uploads and their limit) and GET /v1/blobs/{sha256} (signed local-store URLs)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import time
import urllib.parse

import pytest
from gunicorn.http.errors import ChunkMissingTerminator
from werkzeug.exceptions import ClientDisconnected
from werkzeug.test import EnvironBuilder, TestResponse
from werkzeug.wrappers import Request

from compilesvc.store import S3Store
from compilesvc.store.local import LocalStore
from compilesvc.store.signing import sign_blob_url
from tests.web.support import PUBLIC_URL, Env
from tests.web.test_submit import assert_problem
from web.contract.schemas import UploadOut


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


def post_stream(env: Env, stream: io.RawIOBase, content_length: int | None, *, terminated: bool = False,
                path: str = "/v1/models", headers: dict[str, str] | None = None,
                content_type: str | None = "application/octet-stream") -> TestResponse:
    """POST a non-seekable body the way a WSGI server passes it: with a Content-Length, or chunked
    (no length, ``wsgi.input_terminated`` set, as gunicorn does). Werkzeug's test client would seek.
    ``terminated`` also sets ``wsgi.input_terminated`` with a Content-Length (gunicorn does, the dev
    server does not): werkzeug then takes a short body for the end instead of raising."""
    environ = EnvironBuilder(path=path, method="POST", content_type=content_type, headers=headers).get_environ()
    environ["wsgi.input"] = io.BufferedReader(stream)
    if content_length is None:
        environ.pop("CONTENT_LENGTH", None)
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = str(content_length)
        if terminated:
            environ["wsgi.input_terminated"] = True
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
    refused = post_stream(sqlite_env, stream, 200_000, content_type=content_type)
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


@pytest.mark.parametrize("content_type", [None, "application/octet-stream",
                                          "Application/Octet-Stream; charset=binary"])
def test_raw_bodies_are_accepted_with_or_without_a_type(sqlite_env: Env, content_type: str | None) -> None:
    # No Content-Type: what requests.post(url, data=f) sends; compilesvc upload sends octet-stream.
    response = post_stream(sqlite_env, CountingStream(1000), 1000, content_type=content_type)
    assert response.status_code == 201, response.get_data(as_text=True)
    assert response.json["size"] == 1000


@pytest.mark.parametrize("content_type", ["application/zip", "text/plain", "application/json"])
def test_other_typed_bodies_are_refused_with_the_hint(sqlite_env: Env, content_type: str) -> None:
    stream = CountingStream(1000)
    response = post_stream(sqlite_env, stream, 1000, content_type=content_type)
    body = assert_problem(response, 415, "unsupported-media-type")
    assert "application/octet-stream" in body["detail"] and body["hint"].startswith("curl --data-binary")
    assert stream.consumed == 0 and response.headers["Accept-Post"] == "application/octet-stream"


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


# -- all or nothing: cut-off bodies and declared digests (Flask test client, both stores) ----------------------

MiB = 1024 * 1024


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def any_store_env(request: pytest.FixtureRequest) -> Env:
    return request.getfixturevalue("sqlite_env" if request.param == "local" else "s3_env")  # type: ignore[no-any-return]


def store_contents(env: Env) -> tuple[list[str], list[str]]:
    """(every object or file in the store, every write still open: temp files or multipart uploads)."""
    store = env.services.store
    if isinstance(store, LocalStore):
        files = sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())
        return [f for f in files if not f.startswith("tmp/")], [f for f in files if f.startswith("tmp/")]
    assert isinstance(store, S3Store)
    objects = store.client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/").get("Contents", [])
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/").get("Uploads", [])
    return sorted(o["Key"] for o in objects), sorted(u["Key"] for u in uploads)


def model_bytes(size: int) -> bytes:
    return b"m" * size  # what CountingStream produces


class DroppingStream(io.RawIOBase):
    """``size`` bytes of body, then the server's body reader raises ``error`` (the connection went away)."""

    def __init__(self, size: int, error: BaseException):
        self.remaining = size
        self.error = error

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        if not self.remaining:
            raise self.error
        n = min(len(buffer), self.remaining)
        buffer[:n] = b"m" * n
        self.remaining -= n
        return n


@pytest.mark.parametrize("terminated", [False, True], ids=["dev-server", "gunicorn-style"])
def test_body_shorter_than_content_length_is_refused(any_store_env: Env, terminated: bool) -> None:
    env = any_store_env
    before = store_contents(env)
    response = post_stream(env, CountingStream(MiB), 2 * MiB, terminated=terminated)
    body = assert_problem(response, 400, "upload-incomplete")
    assert (body["received_bytes"], body["expected_bytes"]) == (MiB, 2 * MiB)
    assert f"received {MiB} of {2 * MiB} bytes" in body["detail"]
    assert not env.services.store.has_blob(hashlib.sha256(model_bytes(MiB)).hexdigest())
    assert store_contents(env) == before
    # The same request, whole, is stored.
    whole = post_stream(env, CountingStream(2 * MiB), 2 * MiB, terminated=terminated)
    assert whole.status_code == 201 and whole.json["size"] == 2 * MiB


@pytest.mark.parametrize("error", [ConnectionResetError("peer reset"), ChunkMissingTerminator(b""),
                                   ClientDisconnected()], ids=["os-error", "chunk-parser", "werkzeug"])
def test_chunked_body_cut_before_its_last_chunk_is_refused(any_store_env: Env, error: Exception) -> None:
    env = any_store_env
    before = store_contents(env)
    body = assert_problem(post_stream(env, DroppingStream(3 * MiB, error), None), 400, "upload-incomplete")
    assert body["received_bytes"] == 3 * MiB and body["expected_bytes"] is None
    assert "without its last chunk" in body["detail"]
    assert store_contents(env) == before


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def test_declared_digests_are_verified(any_store_env: Env) -> None:
    env = any_store_env
    data = os.urandom(200_000)
    right, wrong = hashlib.sha256(data), hashlib.sha256(data + b"!")
    for headers, path in [
        ({"Content-Digest": f"sha-256=:{b64(wrong.digest())}:"}, "/v1/models"),
        ({"Content-Digest": f"sha-512=:{b64(hashlib.sha512(data).digest())}:, sha-256=:{b64(wrong.digest())}:"},
         "/v1/models"),
        ({"Digest": f"SHA-256={b64(wrong.digest())}"}, "/v1/models"),
        ({}, f"/v1/models?sha256={wrong.hexdigest()}"),
    ]:
        before = store_contents(env)
        refused = env.client.post(path, data=data, headers=headers)
        body = assert_problem(refused, 400, "digest-mismatch")
        assert (body["expected_sha256"], body["actual_sha256"]) == (wrong.hexdigest(), right.hexdigest())
        assert not env.services.store.has_blob(right.hexdigest())
        assert store_contents(env) == before
    for headers, path in [
        ({"Content-Digest": f"sha-256=:{b64(right.digest())}:"}, "/v1/models"),
        ({"Digest": f"md5=anything, sha-256={b64(right.digest())}"}, "/v1/models"),
        ({"Content-Digest": f"sha-256=:{b64(right.digest())}:", "Digest": f"sha-256={b64(right.digest())}"},
         f"/v1/models?sha256={right.hexdigest().upper()}"),
        # Only an algorithm this service does not verify: ignored, as RFC 9530 allows.
        ({"Content-Digest": f"sha-512=:{b64(hashlib.sha512(b'other').digest())}:"}, "/v1/models"),
    ]:
        accepted = env.client.post(path, data=data, headers=headers)
        assert accepted.status_code == 201, accepted.get_data(as_text=True)
        assert accepted.json["sha256"] == right.hexdigest()


@pytest.mark.parametrize(("headers", "query", "field"), [
    ({"Content-Digest": "sha-256=abc"}, "", "header Content-Digest"),  # a token, not a byte sequence
    ({"Content-Digest": "sha-256=:YWJj:"}, "", "header Content-Digest"),  # 3 bytes, not 32
    ({"Content-Digest": "sha-256=:not base64!:"}, "", "header Content-Digest"),
    ({"Content-Digest": "sha-256=:" + "A" * 43 + "=:,"}, "", "header Content-Digest"),  # trailing comma
    ({"Digest": "sha-256"}, "", "header Digest"),
    ({"Digest": "sha-256=!!!!"}, "", "header Digest"),
    ({"Digest": "sha-256=" + b64(b"short")}, "", "header Digest"),
    ({}, "?sha256=xyz", "sha256"),
    ({}, "?sha256=" + "a" * 63, "sha256"),
    ({"Content-Digest": "sha-256=:" + b64(b"a" * 32) + ":"}, "?sha256=" + "b" * 64, "sha256"),  # disagree
])
def test_malformed_digests_are_refused_before_reading(
    sqlite_env: Env, headers: dict[str, str], query: str, field: str
) -> None:
    stream = CountingStream(100_000)
    response = post_stream(sqlite_env, stream, 100_000, path=f"/v1/models{query}", headers=headers)
    body = assert_problem(response, 400, "invalid-request")
    assert field in [e["field"] for e in body["errors"]]
    assert stream.consumed == 0


def test_an_empty_chunked_body_stores_nothing(any_store_env: Env) -> None:
    response = post_stream(any_store_env, CountingStream(0), None)
    assert_problem(response, 400, "invalid-request")
    assert any_store_env.services.store.blob_size(hashlib.sha256(b"").hexdigest()) is None
