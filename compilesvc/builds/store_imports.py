"""What the store has and the ledger lacks (another region published it, or the ledger was rebuilt): bucket
manifests of a spec's buckets, and an artifact manifest's buckets as bucket manifests. A submit records them
as compiled rather than compiling again."""

from __future__ import annotations

from sqlalchemy import select

from compilesvc.ledger.models import BucketCompile
from compilesvc.services import Services
from compilesvc.spec.keys import KeySet
from compilesvc.spec.manifest import ArtifactManifest, BucketManifest, parse_bucket_manifest
from compilesvc.store.base import bucket_manifest_name


def importable_buckets(services: Services, keys: KeySet) -> dict[str, BucketManifest]:
    """Bucket manifests present in the store for buckets the ledger does not know (read outside any
    transaction: no row locks are held across network calls)."""
    with services.sessions() as session:
        known = set(session.scalars(select(BucketCompile.key).where(BucketCompile.key.in_(keys.bucket_keys))))
    found = {}
    for key in keys.bucket_keys:
        if key in known:
            continue
        raw = services.store.read_document(bucket_manifest_name(key))
        if raw is not None:
            found[key] = parse_bucket_manifest(raw, key)
    return found


def bucket_manifests_of(manifest: ArtifactManifest) -> dict[str, BucketManifest]:
    """A published artifact's buckets, each as the bucket manifest its publish wrote."""
    return {
        entry.key: BucketManifest(key=entry.key, material=manifest.material, inputs=entry.inputs,
                                  files=entry.files, log=entry.log, versions=entry.versions,
                                  compile_seconds=entry.compile_seconds, created_at=manifest.created_at)
        for entry in manifest.buckets
    }
