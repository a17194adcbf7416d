"""Publishing one compile's outputs: every output file as a blob, the compile log as a blob, then the
bucket manifest, create-only (an earlier attempt's manifest for the same key wins: its files are as good).

Retrying a store that is down is :mod:`workers.retries`' job; the ledger record is the runner's.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from compilesvc import leases
from compilesvc.manifest import BucketManifest, FileEntry, parse_bucket_manifest
from compilesvc.services import Services
from compilesvc.store import StoreError, bucket_manifest_name

log = logging.getLogger(__name__)

LOG_NAME = "compile.log"


class PublishError(Exception):
    """The child's result cannot be published as it is (a path outside out_dir, a file changed)."""


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


def publish_outputs(services: Services, claim: leases.Claim, out_dir: Path, result: dict[str, Any],
                    log_entry: FileEntry | None, worker_id: str) -> BucketManifest:
    """Store every output file, then the bucket manifest (create-only). Returns the manifest in the store,
    which is an earlier attempt's when one got there first (same key: its files are as good as ours)."""
    store = services.store
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
    name = bucket_manifest_name(claim.key)
    if store.create_document(name, manifest.to_bytes()):
        return manifest
    existing = store.read_document(name)
    if existing is None:
        raise StoreError(f"{name} exists but cannot be read")
    return parse_bucket_manifest(existing, claim.key)


def archive_log(services: Services, *, logs_path: Path, bucket_id: int) -> FileEntry | None:
    """Store the (closed) compile log as a blob; None (logged) if the store refuses."""
    try:
        info = services.store.put_file(logs_path)
    except (StoreError, OSError) as exc:
        log.warning("could not archive the compile log", extra={"error": str(exc), "bucket_compile_id": bucket_id})
        return None
    return FileEntry(path=LOG_NAME, role="log", size=info.size, sha256=info.sha256)
