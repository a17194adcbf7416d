"""``/v1/artifacts``: look up a published artifact by key (the serving fleet's hot path) and resolve a spec
to its keys without building anything.

``GET /v1/artifacts/{key}`` on a cached manifest touches neither the ledger nor the store: it signs the
download URLs and serialises. See :class:`web.context.ManifestCache`.

``/signature`` and ``/provenance`` serve the publisher's signed documents as the store holds them
(Sigstore bundles, :mod:`compilesvc.signing.artifacts`): clients verify them against the public keys they
were configured with, never against anything this API says.

A manifest never changes once published; only the URLs signed into each answer do. So an answer carries
a weak ETag and may be reused (``private``, ``immutable``) for half the URLs' lifetime, which leaves every
URL in a reused answer at least that long to run; ``If-None-Match`` with the tag answers 304 at once.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, request
from sqlalchemy import select

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission
from compilesvc.ledger.models import Artifact, BucketCompile
from compilesvc.pinning.pins import ModelRefError
from compilesvc.signing.keys import public_pem
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import KEY_SCHEMA
from compilesvc.states import ArtifactState
from compilesvc.store.base import artifact_provenance_name, artifact_signature_name
from web import readers
from web.api.builds import model_ref_problem
from web.api.params import raw_json_response, respond, spec_body
from web.auth import current_principal
from web.context import web
from web.contract.openapi import operation
from web.contract.problems import Problem
from web.contract.schemas import ArtifactOut, ResolveOut, SigningKeysOut

bp = Blueprint("artifacts", __name__, url_prefix="/v1/artifacts")
ARTIFACTS = Permission.ARTIFACTS  # fleet tokens too
#: A Sigstore bundle (v0.3) with one DSSE envelope, as model-signing writes it.
BUNDLE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["mediaType", "verificationMaterial", "dsseEnvelope"],
    "properties": {
        "mediaType": {"type": "string"},
        "verificationMaterial": {"type": "object", "description": "`publicKey.hint`: the signing key's id (sha256 "
                                                                  "hex of its PEM SubjectPublicKeyInfo)."},
        "dsseEnvelope": {"type": "object", "description": "`payload` (base64 in-toto Statement), `payloadType`, "
                                                          "`signatures`."},
    },
}


@bp.get("/<sha256:key>")
@operation(summary="A published artifact: manifest and fresh download URLs", tag="artifacts", access=ARTIFACTS,
           description="Files with sizes and sha256, compiler versions, timings, and download URLs that expire "
                       "after `urls_expire_in` seconds. 404 while the artifact is not published (`state` says "
                       "what it is doing) or when the key is unknown. The manifest never changes: the answer "
                       "has a weak `ETag` and may be reused for half of `urls_expire_in`; `If-None-Match` "
                       "with the tag answers 304.",
           responses={200: ArtifactOut, 304: None}, problems=(404,),
           response_headers={200: {"ETag": "Weak validator of the manifest (the URLs aside).",
                                   "Cache-Control": "private, max-age=<half the URL lifetime>, immutable"},
                             304: {"ETag": "As on the 200."}})
def get_artifact(key: str) -> Response:
    g.artifact_key = key
    ctx = web()
    # Before the manifest: another team's artifact answers as an unknown key. A key remembered as absent
    # (neither ledger nor store had it) is answered 404 from memory below without asking whose it is, so a
    # fleet polling for a key nobody built costs no query under the team boundary either.
    if not (ctx.manifests.get(key) is None and ctx.manifests.known_absent(key)):
        readers.require_key(key)
    entry = ctx.published(key, remember_absence=True)
    ttl = ctx.settings.url_ttl_seconds
    headers = {"ETag": f'W/"{entry.etag}"', "Cache-Control": f"private, max-age={ttl // 2}, immutable"}
    ctx.fetches.record(key)  # in memory; written in batches (retention keeps what fleets still fetch)
    if request.if_none_match.contains_weak(entry.etag):
        return Response(status=304, headers=headers)
    return raw_json_response(ctx.describe_json(entry), headers=headers)


def _signed_document(key: str, name: str, what: str) -> Response:
    readers.require_key(key)  # under the team boundary, another team's artifact answers as an unknown key
    entry = web().published(key)  # 404 problems for an unknown or unpublished key
    raw = web().services.store.read_document(name)
    if raw is None:
        raise Problem("artifact-unsigned", f"artifact {key} is published without {what}", state="published")
    return raw_json_response(raw, headers={"Cache-Control": "private, max-age=3600, immutable",
                                           "ETag": f'W/"{entry.etag}"'})


@bp.get("/<sha256:key>/signature")
@operation(summary="A published artifact's signature (OpenSSF model-signing bundle)", tag="artifacts",
           access=ARTIFACTS,
           description="The Sigstore bundle signing the artifact's files and manifest, as `model_signing verify "
                       "key` reads it (`model.sig` in a fetched directory). Verify it with the service's public "
                       "key obtained out of band (docs/fleet.md). 404 `artifact-unsigned` when the artifact was "
                       "published without one.",
           responses={200: ("application/json", BUNDLE_SCHEMA)}, problems=(404,))
def get_signature(key: str) -> Response:
    g.artifact_key = key
    return _signed_document(key, artifact_signature_name(key), "a signature")


@bp.get("/<sha256:key>/provenance")
@operation(summary="A published artifact's signed SLSA provenance", tag="artifacts", access=ARTIFACTS,
           description="A Sigstore bundle whose DSSE payload is an in-toto Statement with an SLSA v1 provenance "
                       "predicate: the output files' digests, the key's components, the pinned model digest, "
                       "the exact toolchain, the builder, the workers, the start and end times. Signed by the "
                       "same key as the signature. 404 `artifact-unsigned` when there is none.",
           responses={200: ("application/json", BUNDLE_SCHEMA)}, problems=(404,))
def get_provenance(key: str) -> Response:
    g.artifact_key = key
    return _signed_document(key, artifact_provenance_name(key), "a provenance statement")


@bp.get("/signing-keys")
@operation(summary="The public keys this service signs with (convenience, not a trust anchor)", tag="artifacts",
           access=ARTIFACTS,
           description="The key this API process signs with (`current`) and the other public keys it was configured "
                       "to trust (`COMPILESVC_TRUSTED_KEYS`, e.g. the previous key during a rotation). For an "
                       "operator comparing key ids: a fleet must take its trusted keys from its own configuration, "
                       "never from this answer, which whoever controls the API could change.",
           responses={200: SigningKeysOut})
def signing_keys() -> Response:
    services = web().services
    current = services.signer.key.key_id if services.signer is not None else None
    keys = [{"key_id": key_id, "public_key": public_pem(key).decode(), "current": key_id == current}
            for key_id, key in services.trusted_keys().keys.items()]
    return respond(SigningKeysOut, {"keys": sorted(keys, key=lambda k: not k["current"])})


@bp.post("/resolve")
@operation(summary="Resolve a spec to its keys and state (never builds)", tag="artifacts", request=CompileSpec,
           access=ARTIFACTS,
           description="The artifact key, bucket keys and key components a submit of this spec would use, "
                       "what the ledger knows about them, and the artifact if it is published. Read-only, but for the "
                       "background hash of a large S3 model it pins (503 `model-pinning` while that runs).",
           responses={200: ResolveOut}, problems=(400, 413, 422, 503))
def resolve() -> Response:
    ctx = web()
    spec = spec_body()
    try:
        # A fleet token pins the spec's model as a submit would: only from its team's model sources.
        principal = current_principal()
        pinned, keys = ctx.submitter.keys_for(spec, team=principal.team if principal is not None else None)
    except ModelRefError as exc:
        raise model_ref_problem(exc) from None
    g.artifact_key = keys.key
    who = readers.reader()
    # Under the team boundary what the reader may not read is "absent": a submit would make it its own.
    with ctx.services.sessions() as session:
        state = session.scalar(select(Artifact.state).where(Artifact.key == keys.key,
                                                            *team_reads.artifact_conditions(who)))
        bucket_states = {key: bucket_state for key, bucket_state in session.execute(
            select(BucketCompile.key, BucketCompile.state).where(
                BucketCompile.key.in_(keys.bucket_keys), *team_reads.compile_conditions(who, BucketCompile.id))
        )}
    artifact = None
    if (state is None and not who.bounded) or state == ArtifactState.PUBLISHED:
        try:
            manifest = ctx.published_manifest(keys.key)
        except Problem:
            manifest = None  # not in the ledger nor the store: nothing is built yet
        if manifest is not None:
            state = ArtifactState.PUBLISHED
            artifact = ctx.describe(manifest)
    return respond(ResolveOut, {
        "key": keys.key, "schema_version": KEY_SCHEMA, "components": keys.components,
        "buckets": [{"key": b.key, "position": b.position, "inputs": b.inputs,
                     "state": bucket_states.get(b.key, "absent")} for b in keys.buckets],
        "state": state or "absent",
        "model": {"uri": pinned.uri, "sha256": pinned.sha256, "size": pinned.size},
        "artifact": artifact,
    })
