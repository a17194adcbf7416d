"""What signing costs: ``python -m bench.signing [--buckets N] [--size-mib M] [--rounds R]``.

Two figures against the issue's targets (issue 25, "Done when"):

- **signing per publish**: :func:`compilesvc.compiles.publishing.sign_published` as a publish runs it, on a real local
  store: building the model-signing statement and the SLSA provenance, two ECDSA P-256 signatures and two
  create-only documents (each fsynced, as the local store writes every document). Median of ``--rounds``
  (the documents are deleted between rounds, so every round signs). Target ≤ 5 ms. Recorded twice: the whole
  call, and its computing part alone (statements and signatures, no store), so a slow disk shows as such.
- **verified open vs hash-only open**: opening a cached artifact of ``--buckets`` x 3 files (``--size-mib``
  in all) with the fleet library, which checks the signature and then hashes every file
  (:class:`compilesvc.fleet.Fetcher`, offline), against what an open did before signatures: read the
  manifest and hash every file against it (``ArtifactCache.read`` + ``damaged``). Medians, alternated, page
  cache warm for both. Target ≤ 1.1x.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench._table import record
from compilesvc.compiles.publishing import sign_published
from compilesvc.fleet import ArtifactCache, Fetcher, Verify
from compilesvc.fleet._cache import placed_files
from compilesvc.ledger.models import BucketCompile
from compilesvc.signing.artifacts import ArtifactSigner, manifest_digest, provenance_statement
from compilesvc.signing.keys import SigningKey, TrustedKeys
from compilesvc.spec.keys import artifact_key_of, bucket_key_of
from compilesvc.spec.manifest import ArtifactBucketEntry, ArtifactManifest, BucketManifest, FileEntry
from compilesvc.store.base import artifact_provenance_name, artifact_signature_name, bucket_manifest_name
from compilesvc.store.local import LocalStore

NAME = "signing"
MIB = 1024 * 1024


def _material() -> dict[str, Any]:
    return {"schema": "compilesvc-key/3", "salt": "", "model": {"sha256": "ab" * 32, "format": "torchscript"},
            "toolchain": {"target": "cpu", "backend": "torchscript", "cpu": {"torch": "2.13.0"}}, "flags": []}


def make_artifact(store: LocalStore, buckets: int, size: int) -> tuple[ArtifactManifest, list[BucketCompile]]:
    """A published artifact in ``store``: ``buckets`` bucket manifests of three files each (``size`` bytes in
    all), and the artifact manifest over them, as the worker and publisher write them."""
    material = _material()
    rng = random.Random(25)
    per_file = max(1, size // (buckets * 3))
    entries, rows = [], []
    now = datetime.now(UTC)
    for position in range(buckets):
        inputs = [{"name": "input_ids", "shape": [1, 8 * (position + 1)], "dtype": "int64"}]
        key = bucket_key_of(material, inputs)
        files = []
        for name in ("model.pt", "weights.bin", "aux.json"):
            info = store.put_stream(io.BytesIO(rng.randbytes(per_file)))
            files.append(FileEntry(path=name, role="model" if name == "model.pt" else "aux", size=info.size,
                                   sha256=info.sha256))
        bucket = BucketManifest(key=key, material=material, inputs=inputs, files=files,
                                versions={"torch": "2.13.0"}, worker="bench-worker", compile_seconds=1.0,
                                created_at=now.isoformat())
        store.create_document(bucket_manifest_name(key), bucket.to_bytes())
        entries.append(ArtifactBucketEntry(key=key, position=position, inputs=inputs,
                                           manifest=bucket_manifest_name(key), files=files,
                                           versions={"torch": "2.13.0"}, compile_seconds=1.0))
        rows.append(BucketCompile(key=key, started_at=now, finished_at=now, worker_id="bench-worker"))
    key = artifact_key_of(material, [e.key for e in entries])
    manifest = ArtifactManifest(key=key, material=material, components={"model": "ab" * 32}, buckets=entries,
                                size_bytes=sum(f.size for e in entries for f in e.files),
                                created_at=now.isoformat())
    return manifest, rows


def bench_signing(store: LocalStore, signer: ArtifactSigner, manifest: ArtifactManifest,
                  rows: list[BucketCompile], rounds: int) -> tuple[float, float]:
    """(whole sign_published, its statements and signatures alone), medians in ms."""
    whole, compute = [], []
    for _ in range(rounds):
        for name in (artifact_signature_name(manifest.key), artifact_provenance_name(manifest.key)):
            store.delete_document(name)
        started = time.perf_counter()
        assert sign_published(store, signer, manifest, rows)
        whole.append(time.perf_counter() - started)
        started = time.perf_counter()
        digest = manifest_digest(manifest)
        signer.sign_provenance(provenance_statement(manifest, builder_id=signer.builder_id, workers=["w"],
                                                    started_on=None, finished_on=None, digest=digest))
        signer.sign_manifest(manifest, digest)
        compute.append(time.perf_counter() - started)
    return statistics.median(whole) * 1000, statistics.median(compute) * 1000


def bench_open(store: LocalStore, signer: ArtifactSigner, manifest: ArtifactManifest, cache_root: Path,
               trusted: TrustedKeys, rounds: int) -> tuple[float, float]:
    cache = ArtifactCache(cache_root)
    placed = placed_files(manifest)
    for p in placed:
        partial = cache.partial_path(p.entry.sha256)
        store.download_blob(p.entry.sha256, partial)
        cache.install_blob(partial, p.entry.sha256)
    bundle = store.read_document(artifact_signature_name(manifest.key))
    assert bundle is not None
    cache.publish(manifest, placed, bundle)
    fetcher = Fetcher(cache, None, trusted=trusted, verify=Verify.SHA256)
    signed, hash_only = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        report = fetcher.fetch(manifest.key)
        signed.append(time.perf_counter() - started)
        assert report.key_id == signer.key.key_id and not report.network
        started = time.perf_counter()
        cached = cache.read(manifest.key)
        assert cached is not None and not cache.damaged(manifest.key, placed_files(cached), Verify.SHA256)
        hash_only.append(time.perf_counter() - started)
    return statistics.median(signed) * 1000, statistics.median(hash_only) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-signing-") as tmp:
        root = Path(tmp)
        store = LocalStore(root / "store", public_url="http://bench.invalid", secret_key=b"bench")
        key = SigningKey.load_or_generate(root / "keys" / "signing-key.pem")
        signer = ArtifactSigner(key, "http://bench.invalid")
        trusted = TrustedKeys({key.key_id: key.public_key})
        manifest, rows = make_artifact(store, args.buckets, args.size_mib * MIB)
        signing_ms, compute_ms = bench_signing(store, signer, manifest, rows, args.rounds)
        record(NAME, f"signature + provenance per publish ({args.buckets} buckets x 3 files), written", signing_ms,
               "ms", at_most=5.0, vs="no signing (0 ms)",
               note=f"median of {args.rounds}; two fsynced create-only documents in a local store")
        record(NAME, "of which statements + 2 ECDSA P-256 signatures", compute_ms, "ms", at_most=5.0,
               vs="no signing (0 ms)", note=f"median of {args.rounds}")
        signed_ms, hash_ms = bench_open(store, signer, manifest, root / "cache", trusted, args.rounds)
        record(NAME, f"verified open of a cached {args.size_mib} MiB artifact", signed_ms / hash_ms, "x",
               at_most=1.1, vs="the hash-only open (manifest + sha256 of every file)",
               note=f"{signed_ms:.1f} ms vs {hash_ms:.1f} ms, median of {args.rounds}")


if __name__ == "__main__":
    main()
