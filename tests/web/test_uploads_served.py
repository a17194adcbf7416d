"""Cut-off uploads through real servers: ``compilesvc serve`` (gunicorn, gthread workers) and
``compilesvc serve --dev`` (Werkzeug's server), on the local store and on S3, over raw sockets.

A client that declares 2 MiB, sends 1 MiB and closes its side looks to the application like a body that
ended; so does a chunked body that stops before its last chunk, unless the server's parser says
otherwise. Each case must answer 400 (when the client still listens) and leave nothing in the store:
no blob, no temp file, no multipart upload.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from compilesvc.store import ArtifactStore, LocalStore, S3Store
from compilesvc.store.s3_client import make_client
from tests.fixtures.s3server import S3Server
from tests.fixtures.serve import compilesvc_serve
from tests.fixtures.tokens import BOOTSTRAP_TOKEN

MiB = 1024 * 1024
SECRET = "served-upload-test-secret"


@dataclass
class Served:
    port: int
    store: ArtifactStore
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def leftovers(self) -> tuple[list[str], list[str]]:
        """(objects or files in the store, writes still open there: temp files or multipart uploads)."""
        if isinstance(self.store, LocalStore):
            files = sorted(str(p.relative_to(self.store.root)) for p in self.store.root.rglob("*") if p.is_file())
            return [f for f in files if not f.startswith("tmp/")], [f for f in files if f.startswith("tmp/")]
        assert isinstance(self.store, S3Store)
        client, bucket, prefix = self.store.client, self.store.bucket, f"{self.store.prefix}/"
        objects = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        return [o["Key"] for o in objects], [u["Key"] for u in uploads]

    def refusals_logged(self) -> int:
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return sum(1 for line in lines if line.get("logger") == "compilesvc.web.access"
                   and line.get("path") == "/v1/models" and line.get("status") == 400)

    def send(self, head: str, *body: bytes, listen: bool = True) -> tuple[int, dict[str, Any]] | None:
        """Send a raw request, then end the connection: half-close and read the answer (``listen``), or
        close outright and never read it."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        try:
            sock.sendall(head.encode("latin-1"))
            for part in body:
                sock.sendall(part)
            if not listen:
                return None
            sock.shutdown(socket.SHUT_WR)
            response = http.client.HTTPResponse(sock)
            response.begin()
            return response.status, json.loads(response.read())
        finally:
            sock.close()


def head(*, length: int | None = None, extra: str = "") -> str:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/models HTTP/1.1\r\nHost: api.test\r\nContent-Type: application/octet-stream\r\n"
            f"Authorization: Bearer {BOOTSTRAP_TOKEN}\r\n"
            f"{framing}\r\n{extra}\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _probe(store_kind: str, tmp_path: Path, s3_server: S3Server) -> tuple[dict[str, str], ArtifactStore]:
    if store_kind == "local":
        root = tmp_path / "store"
        return ({"COMPILESVC_STORE_URL": root.as_uri()},
                LocalStore(root, public_url="http://api.test", secret_key=SECRET.encode()))
    bucket, prefix = s3_server.new_bucket("served"), "svc/uploads"
    session = boto3.Session(aws_access_key_id=s3_server.access_key, aws_secret_access_key=s3_server.secret_key)
    client = make_client(s3_server.endpoint_url, s3_server.region, session=session)
    return ({**s3_server.env(), "COMPILESVC_STORE_URL": f"s3://{bucket}/{prefix}"},
            S3Store(bucket, prefix, client))


@pytest.fixture(params=[("gunicorn", "local"), ("gunicorn", "s3"), ("dev", "local"), ("dev", "s3")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request: pytest.FixtureRequest, tmp_path: Path, s3_server: S3Server) -> Iterator[Served]:
    server, store_kind = request.param
    store_env, store = _probe(store_kind, tmp_path, s3_server)
    env = {**store_env, "COMPILESVC_DATA_DIR": str(tmp_path / "data"), "COMPILESVC_SECRET_KEY": SECRET,
           "TMPDIR": str(tmp_path)}
    extra = ["--dev"] if server == "dev" else ["--threads", "4"]
    with compilesvc_serve(tmp_path, extra, workers=1, env=env) as process:
        yield Served(process.port, store, process.log)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_cut_off_uploads_store_nothing(served: Served) -> None:
    body = os.urandom(2 * MiB)
    half = body[:MiB]

    # Content-Length 2 MiB, 1 MiB sent, then the client half-closes and waits for the answer.
    answer = served.send(head(length=len(body)), half)
    assert answer is not None
    status, problem = answer
    assert status == 400 and problem["type"] == "/problems/upload-incomplete", problem
    assert (problem["received_bytes"], problem["expected_bytes"]) == (MiB, 2 * MiB)

    # The same, but the client closes outright and never reads an answer.
    served.send(head(length=len(body)), half, listen=False)

    # Chunked: cut between chunks, inside a chunk, and after the last chunk's size line but before
    # the blank line that ends the body.
    pieces = [body[i:i + 64 * 1024] for i in range(0, MiB, 64 * 1024)]
    for cut in (b"".join(chunk(p) for p in pieces),
                b"".join(chunk(p) for p in pieces) + b"%x\r\n" % (64 * 1024) + body[MiB:MiB + 1000],
                b"".join(chunk(p) for p in pieces) + b"0\r\n"):
        answer = served.send(head(), cut)
        assert answer is not None
        status, problem = answer
        assert status == 400 and problem["type"] == "/problems/upload-incomplete", problem
        assert problem["expected_bytes"] is None and "last chunk" in problem["detail"]

    # Every refusal, including the one nobody listened to, has been handled: now look at the store.
    deadline = time.monotonic() + 30
    while served.refusals_logged() < 5:
        assert time.monotonic() < deadline, served.log_path.read_text()
        time.sleep(0.1)
    for prefix in (half, body[:MiB + 1000]):
        assert not served.store.has_blob(sha(prefix))
    assert served.leftovers() == ([], [])


def test_whole_uploads_are_stored(served: Served) -> None:
    """The harness can store: the refusals above are the server's doing, not a broken request."""
    body = os.urandom(MiB + 7)
    digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
    answer = served.send(head(length=len(body), extra=f"Content-Digest: sha-256=:{digest}:\r\n"), body)
    assert answer is not None and answer[0] == 201, answer
    assert answer[1]["sha256"] == sha(body) and answer[1]["size"] == len(body)

    chunked = os.urandom(300_000)
    answer = served.send(head(), chunk(chunked[:100_000]), chunk(chunked[100_000:]), b"0\r\n\r\n")
    assert answer is not None and answer[0] == 201, answer
    assert served.store.has_blob(sha(body)) and served.store.has_blob(sha(chunked))
    assert served.leftovers()[1] == []


def test_declared_uploads_cut_off_or_mismatched_store_nothing(served: Served) -> None:
    """With its size and digest declared (as ``compilesvc upload`` sends them), an S3 store uploads the body's
    parts while it arrives: a body cut off after two parts, or whose last part breaks the digest, must still
    leave no blob and no open multipart upload."""
    body = os.urandom(20 * MiB + 5)
    digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
    declared = head(length=len(body), extra=f"Content-Digest: sha-256=:{digest}:\r\n")
    answer = served.send(declared, body[:17 * MiB])
    assert answer is not None
    status, problem = answer
    assert status == 400 and problem["type"] == "/problems/upload-incomplete", problem
    assert (problem["received_bytes"], problem["expected_bytes"]) == (17 * MiB, len(body))

    answer = served.send(declared, body[:-1] + bytes([body[-1] ^ 1]))
    assert answer is not None and answer[0] == 400, answer
    assert answer[1]["type"] == "/problems/digest-mismatch", answer[1]
    assert served.leftovers() == ([], [])

    answer = served.send(declared, body)
    assert answer is not None and answer[0] == 201 and answer[1]["sha256"] == sha(body), answer
    assert served.leftovers()[1] == []
