"""What a published artifact's signature and provenance say, and the check a fleet runs before using a file.

**The signature** (``artifacts/<key>/model.sig`` in the store, ``model.sig`` in a fetched directory) is
an OpenSSF model-signing v1.0 statement (predicate ``https://model_signing/signature/v1.0``) over the
artifact *as a fetched directory* lays it out (``bucket-<position>/<path>``, :mod:`compilesvc.fleet`):

- one resource per compiled file, named by that path, with its sha256; the subject's digest is the
  sha256 over the resources' digests in their order (model-signing's ``signing.Payload``), the subject's
  name the artifact key;
- ``serialization``: files, sha256, no symlinks; ``ignore_paths`` = the signature itself, the
  directory's ``manifest.json`` and the compile logs (present only with ``--with-logs``), and the git
  paths model-signing ignores by default. So ``model_signing verify key`` passes on a ``fetch --dest``
  directory as it is;
- a ``compilesvc`` member (the v1.0 predicate lets verifiers ignore other members): the artifact key and
  the sha256 of the manifest's canonical JSON (:func:`manifest_digest`: keys sorted, no whitespace),
  which binds what the standard verifier does not read: every file's size, the logs' digests, the
  material, the versions. Computed from the parsed manifest, so the API's and the cache's encodings of
  the same manifest agree.

:func:`verify_artifact` checks all of it: a trusted key signed it, for this key, over exactly this
manifest, naming each resource the manifest has. Each file is then checked against the (now trusted)
manifest's sha256 and size by whoever reads it (the fleet cache, ``compilesvc verify``).

**The provenance** (``artifacts/<key>/provenance.json``) is an in-toto Statement with an SLSA v1
provenance predicate (https://slsa.dev/spec/v1.0/provenance), signed by the same key: subjects = every
compiled file and the manifest; buildDefinition = the key's components and material, the pinned model
digest and the exact toolchain versions the buckets recorded; runDetails = this service as builder, the
workers, the first start and last finish, and the logs and manifest as byproducts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

import orjson

from compilesvc.signing.keys import STATEMENT_TYPE, BadSignature, SigningKey, TrustedKeys, Verified
from compilesvc.spec.manifest import ArtifactManifest

SIGNATURE_PREDICATE = "https://model_signing/signature/v1.0"
SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:compilesvc:build-type:compile:v1"
#: The signature's name in a fetched directory (and model-signing's default name for it).
SIGNATURE_FILE = "model.sig"
MANIFEST_FILE = "manifest.json"
#: model-signing ignores these by default (hashing.Config: ignore_git_paths).
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")


def manifest_digest(manifest: ArtifactManifest) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace; orjson, whose C encoder keeps a
    fleet's open and a publish well inside their budgets: the indented stdlib encoding costs milliseconds)."""
    document = manifest.model_dump(mode="json", by_alias=True)
    return hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()


def signed_files(manifest: ArtifactManifest) -> list[tuple[str, str]]:
    """(path in a fetched directory, sha256) of every compiled file, in model-signing's order (by path
    components, as its manifest sorts ``PurePosixPath`` keys)."""
    files = [(b.placed(f), f.sha256) for b in manifest.buckets for f in b.files]
    return sorted(files, key=lambda item: PurePosixPath(item[0]).parts)


def _log_paths(manifest: ArtifactManifest) -> list[str]:
    return [b.placed(b.log) for b in manifest.buckets if b.log is not None]


def signature_statement(manifest: ArtifactManifest, digest: str | None = None) -> dict[str, Any]:
    """The model-signing v1.0 statement for ``manifest`` (see the module docstring); ``digest`` its
    :func:`manifest_digest` when the caller has it."""
    files = signed_files(manifest)
    root = hashlib.sha256(b"".join(bytes.fromhex(digest) for _, digest in files)).hexdigest()
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest.key, "digest": {"sha256": root}}],
        "predicateType": SIGNATURE_PREDICATE,
        "predicate": {
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": sorted({SIGNATURE_FILE, MANIFEST_FILE, *GIT_PATHS,
                                                      *_log_paths(manifest)})},
            "resources": [{"name": name, "algorithm": "sha256", "digest": digest} for name, digest in files],
            "compilesvc": {"artifact_key": manifest.key, "manifest_sha256": digest or manifest_digest(manifest)},
        },
    }


def verify_artifact(trusted: TrustedKeys, bundle: bytes, manifest: ArtifactManifest) -> Verified:
    """Check ``bundle`` as the signature of ``manifest`` (already parsed against its key): signed by a
    trusted key, for this key, over exactly this manifest and its files. :class:`SignatureError` names
    what failed."""
    key = manifest.key
    verified = trusted.verify(bundle, what=f"the signature of artifact {key}")
    statement, key_id = verified.statement, verified.key_id
    predicate = statement.get("predicate")
    if statement.get("predicateType") != SIGNATURE_PREDICATE or not isinstance(predicate, dict):
        raise BadSignature(f"the signature of artifact {key} (key {key_id}) is not a model signature", key_id)
    ours = predicate.get("compilesvc") or {}
    if ours.get("artifact_key") != key or [s.get("name") for s in statement.get("subject") or []] != [key]:
        raise BadSignature(f"the signature offered for artifact {key} signs artifact "
                           f"{ours.get('artifact_key')} (key {key_id})", key_id)
    if ours.get("manifest_sha256") != manifest_digest(manifest):
        raise BadSignature(f"the manifest of artifact {key} is not the one key {key_id} signed: it was changed "
                           "after publication", key_id)
    signed = {r.get("name"): r.get("digest") for r in predicate.get("resources") or [] if isinstance(r, dict)}
    for name, digest in signed_files(manifest):
        if signed.get(name) != digest:
            raise BadSignature(f"{name} of artifact {key}: its sha256 {digest} is not the one key {key_id} "
                               "signed", key_id)
    return verified


def verify_provenance(trusted: TrustedKeys, bundle: bytes, key: str) -> Verified:
    """Check ``bundle`` as the provenance of artifact ``key``: signed by a trusted key, an SLSA provenance,
    and about this artifact (a validly signed statement of another artifact is not this one's)."""
    verified = trusted.verify(bundle, what=f"the provenance of artifact {key}")
    statement, key_id = verified.statement, verified.key_id
    predicate = statement.get("predicate") or {}
    parameters = (predicate.get("buildDefinition") or {}).get("externalParameters") or {}
    if statement.get("predicateType") != SLSA_PREDICATE or parameters.get("artifact_key") != key:
        raise BadSignature(f"the provenance offered for artifact {key} (key {key_id}) is not an SLSA provenance "
                           f"of that artifact", key_id)
    return verified


def provenance_statement(manifest: ArtifactManifest, *, builder_id: str, workers: Iterable[str],
                         started_on: datetime | None, finished_on: datetime | None,
                         bucket_manifests: Mapping[str, str] | None = None, digest: str | None = None,
                         ) -> dict[str, Any]:
    """The SLSA v1 provenance of a published artifact (see the module docstring). ``bucket_manifests``:
    store name -> sha256 of each bucket manifest, recorded as byproducts; ``digest`` as for
    :func:`signature_statement`."""
    digest = digest or manifest_digest(manifest)
    model = manifest.material.get("model") or {}
    toolchain: dict[str, str] = {}
    for bucket in manifest.buckets:
        for name, version in sorted(bucket.versions.items()):
            if isinstance(version, (str, int, float)) and version != "":
                toolchain.setdefault(name, str(version))
    dependencies: list[dict[str, Any]] = []
    if model.get("sha256"):
        dependencies.append({"name": "model", "digest": {"sha256": model["sha256"]},
                             "annotations": {"format": model.get("format")}})
    dependencies += [{"name": name, "uri": f"pkg:pypi/{name}@{version}"} for name, version in toolchain.items()]
    byproducts: list[dict[str, Any]] = [{"name": MANIFEST_FILE, "digest": {"sha256": digest},
                                         "mediaType": "application/json"}]
    byproducts += [{"name": b.placed(b.log), "digest": {"sha256": b.log.sha256}}
                   for b in manifest.buckets if b.log is not None]
    byproducts += [{"name": name, "digest": {"sha256": digest}} for name, digest in (bucket_manifests or {}).items()]
    metadata: dict[str, Any] = {"invocationId": manifest.key}
    if started_on is not None:
        metadata["startedOn"] = _rfc3339(started_on)
    if finished_on is not None:
        metadata["finishedOn"] = _rfc3339(finished_on)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest}} for name, digest in signed_files(manifest)]
                   + [{"name": MANIFEST_FILE, "digest": {"sha256": digest}}],
        "predicateType": SLSA_PREDICATE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"artifact_key": manifest.key, "components": manifest.components,
                                       "material": manifest.material,
                                       "buckets": [{"key": b.key, "position": b.position, "inputs": b.inputs}
                                                   for b in manifest.buckets]},
                "internalParameters": {"versions": {b.key: b.versions for b in manifest.buckets}},
                "resolvedDependencies": dependencies,
            },
            "runDetails": {
                "builder": {"id": builder_id,
                            "builderDependencies": [{"name": "worker", "uri": f"urn:compilesvc:worker:{w}"}
                                                    for w in sorted(set(workers))]},
                "metadata": metadata,
                "byproducts": byproducts,
            },
        },
    }


def _rfc3339(moment: datetime) -> str:
    text = moment.isoformat()
    return text if moment.tzinfo is not None else f"{text}Z"  # the ledger keeps UTC without a zone


@dataclass(frozen=True)
class ArtifactSigner:
    """The publishing side's key and name: signs what it publishes."""

    key: SigningKey
    builder_id: str

    def sign_manifest(self, manifest: ArtifactManifest, digest: str | None = None) -> bytes:
        return self.key.sign(signature_statement(manifest, digest))

    def sign_provenance(self, statement: Mapping[str, Any]) -> bytes:
        return self.key.sign(statement)


def provenance_summary(verified: Verified) -> dict[str, Any]:
    """The parts of a verified provenance a person reads (the build page, ``compilesvc verify``)."""
    predicate = verified.statement.get("predicate") or {}
    definition = predicate.get("buildDefinition") or {}
    run = predicate.get("runDetails") or {}
    builder = run.get("builder") or {}
    metadata = run.get("metadata") or {}
    return {
        "key_id": verified.key_id,
        "builder": builder.get("id"),
        "workers": [d.get("uri", "").rsplit(":", 1)[-1] for d in builder.get("builderDependencies") or []],
        "started_on": metadata.get("startedOn"),
        "finished_on": metadata.get("finishedOn"),
        "dependencies": [{"name": d.get("name"), "uri": d.get("uri"), "digest": d.get("digest")}
                         for d in definition.get("resolvedDependencies") or []],
        "outputs": [{"name": s.get("name"), "sha256": (s.get("digest") or {}).get("sha256")}
                    for s in verified.statement.get("subject") or []],
    }
