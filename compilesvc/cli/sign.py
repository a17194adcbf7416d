"""``compilesvc sign-artifacts``: the migration of artifacts published before signing (or by a deployment
with ``publish_unsigned``). Run where the service's settings reach its ledger, its store and its signing
key, like ``compilesvc gc``.

For each published artifact without a signature it checks, before signing anything:

- the stored artifact manifest derives its key (:func:`compilesvc.spec.manifest.parse_artifact_manifest`);
- each bucket entry names the same files (path, size, sha256) as that bucket's own manifest in the store,
  which the worker wrote separately;
- every file's blob in the store has the manifest's size and sha256 (each byte is read and hashed).

Then it writes the signature and the provenance (from what the ledger knows: the buckets' start and end
times, the workers in the bucket manifests) exactly as a publish does. An artifact that fails a check is
not signed: it is reported, and it should be rebuilt (``compilesvc gc`` can delete it; a resubmit
compiles it again). What cannot be detected: a manifest changed in the store *together with* its bucket
manifest and blobs before this migration ran; where that is a concern, rebuild instead of signing.

Exit status: 0 every artifact considered is signed (or was already); 1 some could not be verified, or the
ledger or the store failed; 2 a bad option or setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from compilesvc.cli.main import BadInput, CommandFailed, ledger_services

if TYPE_CHECKING:  # the command's imports are made when it runs: `compilesvc --help` stays light
    from compilesvc.spec.manifest import ArtifactManifest
    from compilesvc.store import ArtifactStore


def _check_files(store: ArtifactStore, manifest: ArtifactManifest) -> str | None:
    """Why ``manifest`` cannot be signed as it is in the store (None: every file verified)."""
    from compilesvc.spec.manifest import ManifestMismatch, parse_bucket_manifest  # when it runs (see TYPE_CHECKING)
    from compilesvc.store import BlobNotFound
    from compilesvc.store.hashing import StreamHash

    for bucket in manifest.buckets:
        raw = store.read_document(bucket.manifest)
        if raw is None:
            return f"the bucket manifest {bucket.manifest} is missing"
        try:
            own = parse_bucket_manifest(raw, bucket.key)
        except ManifestMismatch as exc:
            return str(exc)
        if own.files != bucket.files:
            return f"bucket {bucket.position}'s files differ from its bucket manifest {bucket.manifest}"
        for entry in [*bucket.files, *([bucket.log] if bucket.log is not None else [])]:
            hashed = StreamHash()
            try:
                for chunk in store.iter_blob(entry.sha256):
                    hashed.update(chunk)
            except BlobNotFound:
                return f"{bucket.placed(entry)}: its blob {entry.sha256} is missing"
            stored = hashed.result()
            if stored.sha256 != entry.sha256 or stored.size != entry.size:
                return f"{bucket.placed(entry)}: the stored bytes differ from the manifest"
    return None


@click.command("sign-artifacts")
@click.argument("keys", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every published artifact that has no signature yet.")
@click.option("--dry-run", is_flag=True, help="Verify and report; sign nothing.")
def sign_artifacts(keys: tuple[str, ...], every: bool, dry_run: bool) -> None:
    """Verify the stored files of published artifacts KEYS (or --all unsigned ones), then sign them and write
    their provenance (see docs/deploy.md, "Signing keys")."""
    if bool(keys) == every:
        raise BadInput("give artifact KEYS or --all (one of them)")
    # When it runs, not when the CLI lists its commands: the ledger, the store and the signer (start-up cost).
    from sqlalchemy import select

    from compilesvc.compiles.bucket_compiles import positioned_buckets
    from compilesvc.compiles.publishing import sign_published
    from compilesvc.ledger.models import Artifact
    from compilesvc.signing.keys import KeyFileError
    from compilesvc.spec.manifest import ManifestMismatch, parse_artifact_manifest
    from compilesvc.states import ArtifactState
    from compilesvc.store import StoreError
    from compilesvc.store.base import artifact_manifest_name, artifact_provenance_name, artifact_signature_name

    failed = 0
    try:
        with ledger_services() as services:
            try:
                signer = services.signer
            except KeyFileError as exc:
                raise CommandFailed(str(exc)) from None
            if signer is None:
                raise BadInput("publish_unsigned is set: there is no signing key to sign with")
            with services.sessions() as session:
                query = select(Artifact.id, Artifact.key).where(Artifact.state == ArtifactState.PUBLISHED)
                if keys:
                    query = query.where(Artifact.key.in_(keys))
                rows = session.execute(query.order_by(Artifact.id)).all()
            missing = set(keys) - {key for _, key in rows}
            for key in sorted(missing):
                click.echo(f"{key}: not a published artifact", err=True)
                failed += 1
            for artifact_id, key in rows:
                store = services.store
                if store.read_document(artifact_signature_name(key)) is not None and \
                        store.read_document(artifact_provenance_name(key)) is not None:
                    click.echo(f"{key}: already signed")
                    continue
                raw = store.read_document(artifact_manifest_name(key))
                if raw is None:
                    click.echo(f"{key}: not signed: its manifest is missing from the store", err=True)
                    failed += 1
                    continue
                try:
                    manifest = parse_artifact_manifest(raw, key)
                except ManifestMismatch as exc:
                    click.echo(f"{key}: not signed: {exc}", err=True)
                    failed += 1
                    continue
                why = _check_files(store, manifest)
                if why is not None:
                    click.echo(f"{key}: not signed: {why}; rebuild it", err=True)
                    failed += 1
                    continue
                if dry_run:
                    click.echo(f"{key}: verified; would sign with key {signer.key.key_id}")
                    continue
                with services.sessions() as session:
                    buckets = [bucket for bucket, _ in positioned_buckets(session, artifact_id)]
                sign_published(store, signer, manifest, buckets)
                click.echo(f"{key}: verified and signed with key {signer.key.key_id}")
    except StoreError as exc:
        raise CommandFailed(f"the store failed: {exc}") from None
    if failed:
        raise CommandFailed(f"{failed} artifact(s) not signed (see above)")
