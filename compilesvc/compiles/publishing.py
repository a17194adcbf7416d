"""Publishing to the artifact store: a bucket compile's outputs and bucket manifest, and an artifact's
manifest once every bucket of the set succeeded.

Both manifests are written the same way (:func:`create_or_read`): create-only, and when a document of the
same name is already there, that one wins and is read back. The same name means the same key, so an
earlier attempt's or another publisher's document is as good as ours, and every reader sees one version.

Publishing order is blobs, bucket manifests (workers), the artifact manifest, its signature and signed
provenance (:func:`sign_published`, create-only too, by the publishing process's key), then the ledger. A crash
anywhere in between leaves either nothing visible or a complete manifest that the next pass (worker,
reaper or a submit) finds and records. Retrying a store that is down is :mod:`workers.compiling.retries`' job; the
artifact's states are :mod:`compilesvc.lifecycle.artifacts`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.compiles.bucket_compiles import positioned_buckets
from compilesvc.compiles.leases import Claim
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, utcnow
from compilesvc.lifecycle.artifacts import set_artifact_state
from compilesvc.signing.artifacts import ArtifactSigner, manifest_digest, provenance_statement
from compilesvc.spec.manifest import (
    ArtifactBucketEntry,
    ArtifactManifest,
    BucketManifest,
    FileEntry,
    parse_artifact_manifest,
    parse_bucket_manifest,
)
from compilesvc.states import ArtifactState, BucketState
from compilesvc.store import ArtifactStore, StoreError
from compilesvc.store.base import (
    artifact_manifest_name,
    artifact_provenance_name,
    artifact_signature_name,
    bucket_manifest_name,
)

log = logging.getLogger(__name__)

#: The archived compile log's name in manifests (its blob is content-addressed like every file).
LOG_NAME = "compile.log"

M = TypeVar("M", BucketManifest, ArtifactManifest)


class PublishError(Exception):
    """The compiler's result cannot be published as it is (a path outside out_dir, a file changed)."""


def create_or_read(store: ArtifactStore, name: str, manifest: M, parse: Callable[[bytes, str], M]) -> M:
    """Create ``name`` with ``manifest`` unless it exists; return the manifest the store now holds."""
    if store.create_document(name, manifest.to_bytes()):
        return manifest
    existing = store.read_document(name)
    if existing is None:
        raise StoreError(f"{name} exists but cannot be read")
    return parse(existing, manifest.key)


# -- a bucket compile -------------------------------------------------------------------------------------

def _relative_output(out_dir: Path, path: str) -> PurePosixPath:
    candidate = Path(path)
    full = (candidate if candidate.is_absolute() else out_dir / candidate).resolve()
    try:
        relative = full.relative_to(out_dir.resolve())
    except ValueError:
        raise PublishError(f"result file {path!r} is outside the output directory") from None
    if not full.is_file():
        raise PublishError(f"result file {path!r} does not exist")
    return PurePosixPath(relative.as_posix())


def publish_outputs(store: ArtifactStore, claim: Claim, out_dir: Path, result: dict[str, Any],
                    log_entry: FileEntry | None, worker_id: str) -> BucketManifest:
    """Store every output file, then the bucket manifest (create-only). Returns the manifest in the store,
    which is an earlier attempt's when one got there first (same key: its files are as good as ours)."""
    files = []
    for item in result.get("files") or []:
        relative = _relative_output(out_dir, str(item["path"]))
        info = store.put_file(out_dir / relative)
        if item.get("sha256") and item["sha256"] != info.sha256:
            raise PublishError(f"{relative} changed after the compiler reported it")
        files.append(FileEntry(path=str(relative), role=str(item.get("role") or "aux"), size=info.size,
                               sha256=info.sha256))
    if not files:
        raise PublishError("the compiler reported success but no files")
    manifest = BucketManifest(
        key=claim.key, material=claim.material, inputs=claim.inputs, files=files, log=log_entry,
        versions=dict(result.get("versions") or {}), worker=worker_id,
        compile_seconds=result.get("compile_seconds"), created_at=datetime.now(UTC).isoformat(),
    )
    return create_or_read(store, bucket_manifest_name(claim.key), manifest, parse_bucket_manifest)


def archive_log(store: ArtifactStore, *, logs_path: Path, bucket_id: int) -> FileEntry | None:
    """Store the (closed) compile log as a blob; None (logged) if the store refuses."""
    try:
        info = store.put_file(logs_path)
    except (StoreError, OSError) as exc:
        log.warning("could not archive the compile log", extra={"error": str(exc), "bucket_compile_id": bucket_id})
        return None
    return FileEntry(path=LOG_NAME, role="log", size=info.size, sha256=info.sha256)


# -- an artifact (the set of buckets one spec asked for) ---------------------------------------------------

def build_artifact_manifest(store: ArtifactStore, artifact: Artifact,
                            buckets: list[tuple[BucketCompile, int]]) -> ArtifactManifest:
    """The artifact manifest over the bucket manifests already in the store, in the spec's bucket order."""
    entries = []
    for bucket, position in buckets:
        raw = store.read_document(bucket_manifest_name(bucket.key))
        if raw is None:
            raise StoreError(f"bucket manifest for {bucket.key} is missing from the store")
        manifest = parse_bucket_manifest(raw, bucket.key)
        entries.append(ArtifactBucketEntry(
            key=bucket.key, position=position, inputs=manifest.inputs,
            manifest=bucket_manifest_name(bucket.key), files=manifest.files, log=manifest.log,
            versions=manifest.versions, compile_seconds=manifest.compile_seconds,
        ))
    size = sum(f.size for e in entries for f in e.files)
    return ArtifactManifest(key=artifact.key, material=artifact.material, components=artifact.components,
                            buckets=entries, size_bytes=size, created_at=datetime.now(UTC).isoformat())


def sign_published(store: ArtifactStore, signer: ArtifactSigner, manifest: ArtifactManifest,
                   buckets: list[BucketCompile]) -> bool:
    """Write the signature and the signed provenance of a published manifest, create-only (an earlier
    publisher's stay: the same key signs the same manifest). True when this call wrote the signature.
    What the provenance says of the run comes from the ledger's rows (workers, first start, last finish),
    so signing reads nothing more from the store."""
    started = [b.started_at for b in buckets if b.started_at is not None]
    finished = [b.finished_at for b in buckets if b.finished_at is not None]
    digest = manifest_digest(manifest)
    statement = provenance_statement(manifest, builder_id=signer.builder_id,
                                     workers=[b.worker_id for b in buckets if b.worker_id],
                                     started_on=min(started, default=None), finished_on=max(finished, default=None),
                                     digest=digest)
    provenance = signer.sign_provenance(statement)
    signature = signer.sign_manifest(manifest, digest)
    # The two writes run at once: each is a round trip (S3) or an fsync (local store), and the ledger is
    # written only after both, so a crash between them leaves the set building and the next pass (reaper)
    # writes what is missing (create-only: what is there stays).
    with ThreadPoolExecutor(max_workers=1) as beside:
        other = beside.submit(store.create_document, artifact_provenance_name(manifest.key), provenance)
        created = store.create_document(artifact_signature_name(manifest.key), signature)
        other.result()
    return created


def publish_if_complete(store: ArtifactStore, sessions: sessionmaker[Session], artifact_id: int, *,
                        signer: ArtifactSigner | None) -> bool:
    """Publish the artifact if every bucket succeeded. True when this call published it; False when it is not
    complete yet or no longer building. Workers, submits and the reaper all call this, and two of them often
    race for the same complete set (a worker finishing the last bucket while the reaper scans): only the one
    whose update claims the row published it, so only that one may say so."""
    with sessions() as session:
        artifact = session.get(Artifact, artifact_id)
        if artifact is None:
            raise LookupError(f"no artifact {artifact_id}")
        if artifact.state != ArtifactState.BUILDING:
            return False
        buckets = positioned_buckets(session, artifact_id)
        if not buckets or any(b.state != BucketState.SUCCEEDED for b, _ in buckets):
            return False
    name = artifact_manifest_name(artifact.key)
    built = build_artifact_manifest(store, artifact, buckets)
    manifest = create_or_read(store, name, built, parse_artifact_manifest)
    if manifest.buckets != built.buckets:
        # An earlier writer's manifest is signed only if it names what the ledger's buckets published: a
        # manifest that got into the store some other way must not get our signature.
        raise StoreError(f"{name} in the store names other buckets or files than the set's own: not signed, "
                         f"not published (compilesvc sign-artifacts explains such a set; rebuild it)")
    if signer is not None:  # None only where the deployment says so (settings.publish_unsigned)
        sign_published(store, signer, manifest, [b for b, _ in buckets])
    with transaction(sessions) as session:
        claimed = session.execute(
            update(Artifact)
            .where(Artifact.id == artifact_id, Artifact.state == ArtifactState.BUILDING)
            .values(manifest_uri=store.document_location(name), size_bytes=manifest.size_bytes,
                    published_at=utcnow())
            .returning(Artifact.id)
        ).scalar_one_or_none()
        if claimed is None:
            return False
        artifact = session.get_one(Artifact, artifact_id)
        set_artifact_state(session, artifact, ArtifactState.PUBLISHED)
        log.info("artifact published", extra={"artifact_key": artifact.key})
        return True


def publish_ready_artifacts(store: ArtifactStore, sessions: sessionmaker[Session], bucket_id: int, *,
                            signer: ArtifactSigner | None) -> None:
    """After a bucket succeeded: publish each set containing it that is now complete."""
    with sessions() as session:
        artifact_ids = session.scalars(
            select(ArtifactBucket.artifact_id)
            .join(Artifact, Artifact.id == ArtifactBucket.artifact_id)
            .where(ArtifactBucket.bucket_compile_id == bucket_id, Artifact.state == ArtifactState.BUILDING)
        ).all()
    for artifact_id in artifact_ids:
        publish_if_complete(store, sessions, artifact_id, signer=signer)
