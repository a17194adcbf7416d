"""Helpers for the web tests (and ``bench/api_throughput.py``): an app over real services, a model upload,
and finishing bucket compiles the way a worker records them, without running a compiler.

:func:`complete_build` goes through the same core paths a worker uses: ``leases.claim`` takes the compile,
the compiled files and the bucket manifest are written to the real store, log lines are appended with
``logs.append_lines``, ``leases.succeed`` records the result, and
``publishing.publish_ready_artifacts`` publishes the set. Only the compiler is missing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import select

from compilesvc.compiles import leases
from compilesvc.compiles.failures import ArchivedLog
from compilesvc.compiles.logs import append_lines
from compilesvc.compiles.publishing import publish_ready_artifacts
from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ArtifactBucket, BucketCompile, Build
from compilesvc.services import Services
from compilesvc.spec.manifest import BucketManifest, FileEntry
from compilesvc.store.base import bucket_manifest_name
from tests.fixtures.settings import make_settings as fixture_settings

PUBLIC_URL = "http://api.test"
WORKER = "test-worker-1"


def make_settings(tmp_path: Path, database_url: str, **overrides: Any) -> Settings:
    """The shared test settings as the API sees them: a public URL, a signing key, live workers required."""
    return fixture_settings(tmp_path, database_url, **{"public_url": PUBLIC_URL, "secret_key": "web-test-secret",
                                                       "require_live_worker": True, **overrides})


@dataclass
class Env:
    """An app over real services (ledger, store, filesystem broker) and its test client."""

    app: Flask
    client: FlaskClient
    services: Services
    token: str  # the client's (admin) token

    @property
    def settings(self) -> Settings:
        return self.services.settings

    def upload(self, data: bytes = b"a tiny torchscript model") -> str:
        response = self.client.post("/v1/models", data=data, content_type="application/octet-stream")
        assert response.status_code == 201, response.get_data(as_text=True)
        return str(response.json["uri"])  # type: ignore[index]

    def submit(self, spec: dict[str, Any], *, queue_anyway: bool = True, **headers: str) -> Any:
        url = "/v1/builds?queue_anyway=true" if queue_anyway else "/v1/builds"
        return self.client.post(url, data=json.dumps(spec), content_type="application/json", headers=headers)


def spec_for(uri: str, *, buckets: tuple[tuple[int, int], ...] = ((1, 8), (2, 8)), sdk: str = "2.13.0",
             target: str = "cpu", labels: dict[str, str] | None = None, name: str = "tiny-bert") -> dict[str, Any]:
    return {
        "model": {"uri": uri, "format": "torchscript", "name": name},
        "target": target,
        "sdk": sdk,
        "buckets": [{"batch_size": b, "seq_len": s} for b, s in buckets],
        "labels": labels or {},
    }


def queued_buckets(services: Services, build_id: int) -> list[int]:
    with services.sessions() as session:
        artifact_id = session.scalar(select(Build.artifact_id).where(Build.id == build_id))
        return list(session.scalars(
            select(BucketCompile.id)
            .join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
            .where(ArtifactBucket.artifact_id == artifact_id, BucketCompile.state == "queued")
            .order_by(ArtifactBucket.position)
        ))


def complete_build(services: Services, build_id: int, *, log_lines: tuple[str, ...] = ("compiling", "done"),
                   compile_seconds: float = 1.5, payload: Callable[[str], bytes] | None = None,
                   versions: dict[str, Any] | None = None,
                   files: Callable[[str], dict[str, tuple[str, bytes]]] | None = None) -> None:
    """Finish every queued compile of the build's artifact successfully, then publish it. Each bucket's
    model file is ``payload(bucket key)`` (default: a few bytes naming the key), or its files are
    ``files(bucket key)`` (path -> (role, bytes), e.g. NxDI's compiled directory); ``versions`` are what the
    manifests record."""
    store = services.store
    for bucket_id in queued_buckets(services, build_id):
        with transaction(services.sessions) as session:
            claim = leases.claim(session, bucket_id, WORKER, lease_seconds=60)
        assert claim is not None
        content = payload(claim.key) if payload is not None else f"compiled {claim.key}".encode()
        wanted = files(claim.key) if files is not None else {"model.pt": ("model", content)}
        entries = []
        for path, (role, data) in wanted.items():
            blob = store.put_stream(io.BytesIO(data))
            entries.append(FileEntry(path=path, role=role, size=blob.size, sha256=blob.sha256))
        log = store.put_stream(io.BytesIO("\n".join(log_lines).encode()))
        recorded = versions if versions is not None else {"torch": "2.13.0", "compilesvc": "0.1.0"}
        manifest = BucketManifest(
            key=claim.key, material=claim.material, inputs=claim.inputs, files=entries,
            log=FileEntry(path="compile.log", role="log", size=log.size, sha256=log.sha256),
            versions=recorded, worker=WORKER, compile_seconds=compile_seconds,
            created_at=datetime.now(UTC).isoformat(),
        )
        name = bucket_manifest_name(claim.key)
        store.create_document(name, manifest.to_bytes())
        with transaction(services.sessions) as session:
            append_lines(session, bucket_id, claim.attempt, list(log_lines))
            assert leases.succeed(session, bucket_id, claim.token, store.document_location(name), recorded,
                                  compile_seconds)
        publish_ready_artifacts(store, services.sessions, bucket_id, signer=services.signer)


def fail_build(services: Services, build_id: int, *, error_class: str = "compile", code: str = "NCC_EXTP004",
               message: str = "unsupported operator aten::foo", log_lines: tuple[str, ...] = ("error: boom",)) -> None:
    """Fail the build's first queued compile (a compile error fails the whole set), archiving its log as the
    worker does."""
    bucket_id = queued_buckets(services, build_id)[0]
    with transaction(services.sessions) as session:
        claim = leases.claim(session, bucket_id, WORKER, lease_seconds=60)
        assert claim is not None
    blob = services.store.put_stream(io.BytesIO("\n".join(log_lines).encode()))
    with transaction(services.sessions) as session:
        append_lines(session, bucket_id, claim.attempt, list(log_lines))
        assert leases.fail(session, bucket_id, claim.token, error_class, code, message,
                           archived=ArchivedLog(blob.sha256, blob.size)) is not None


def add_log_lines(services: Services, build_id: int, lines: list[str]) -> None:
    """Append lines to the build's first compile, as a running worker would."""
    with services.sessions() as session:
        artifact_id = session.scalar(select(Build.artifact_id).where(Build.id == build_id))
        bucket_id = session.scalar(select(ArtifactBucket.bucket_compile_id)
                                   .where(ArtifactBucket.artifact_id == artifact_id)
                                   .order_by(ArtifactBucket.position).limit(1))
    assert bucket_id is not None
    with transaction(services.sessions) as session:
        append_lines(session, bucket_id, 1, lines)
