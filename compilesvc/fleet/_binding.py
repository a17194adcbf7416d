"""An artifact bound to the spec a fleet asked for: its signed key material recomputed from that spec.

A fleet naming its artifact by spec gets the key from the API's resolve answer or from the cache's ``specs/``
entry; neither is signed, so either could name another (validly signed) artifact. The signed manifest carries the
key material its key derives from (:mod:`compilesvc.spec.manifest`, signed in :mod:`compilesvc.signing.artifacts`):
this module recomputes that material from the spec the fleet holds (:mod:`compilesvc.spec.keys`), filling in only
what a spec does not pin, from the manifest: the service's salt, the model's sha256 unless the spec names a
``blob:sha256:`` model (an S3 or file model is pinned by the server; an hf-checkpoint's key holds its config.json
and, when pre-sharded, its weights' digests, which the fleet has no copy of), and the ISA a cpu aotinductor spec
leaves to the worker. Everything else (target, backend, SDK and its exact toolchain, tensor parallelism, the
NeuronConfig, compiler flags, the buckets' inputs) must give the manifest's key, or :class:`NotTheSpec` names the
parts that differ.
"""

from __future__ import annotations

import json
import re
from typing import Any

from compilesvc.fleet._remote import Untrusted
from compilesvc.spec.manifest import ArtifactManifest

_BLOB_URI = re.compile(r"blob:sha256:([0-9a-f]{64})")


class NotTheSpec(Untrusted):
    """A validly signed artifact whose signed key material is not the spec's: nothing of it is used."""


def check_binding(spec_document: dict[str, Any], manifest: ArtifactManifest, *, source: str) -> None:
    """Raise :class:`NotTheSpec` unless ``manifest`` (signature already verified) is the artifact of
    ``spec_document``; ``source`` says where the key came from (the API's answer, the cache's ``specs/`` entry)."""
    from compilesvc.spec.keys import artifact_key_of, bucket_key_of, nxdi_material, presharded, set_material
    from compilesvc.spec.neuron_releases import UnknownRelease
    from compilesvc.spec.parsing import SpecError, parse_spec

    signed = manifest.material
    try:
        spec = parse_spec(dict(spec_document), limits=None, extra_flags=None)
    except SpecError as exc:
        raise NotTheSpec(f"the spec is invalid, so {manifest.key} cannot be checked against it: {exc}") from None
    signed_model: dict[str, Any] = signed["model"] if isinstance(signed.get("model"), dict) else {}
    salt = str(signed.get("salt", ""))
    try:
        if spec.backend == "nxdi":
            from compilesvc.spec.checkpoint import CheckpointMaterial

            weights = signed_model.get("weights") if presharded(spec) else None
            expected = nxdi_material(spec, CheckpointMaterial({}, weights), salt)
            # The checkpoint's config.json is the server's reading of a model the fleet has no copy of.
            expected["model"] = {**expected["model"], "config": signed_model.get("config")}
            inputs: list[list[dict[str, Any]]] = [[]]
        else:
            pinned = _BLOB_URI.fullmatch(spec.model.uri)
            model_sha256 = pinned.group(1) if pinned else str(signed_model.get("sha256", ""))
            toolchain: dict[str, Any] = signed["toolchain"] if isinstance(signed.get("toolchain"), dict) else {}
            expected = set_material(spec, model_sha256=model_sha256, salt=salt,
                                    default_isa=str(toolchain.get("isa") or "x86_64-unknown"))
            inputs = [[{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in bucket.inputs]
                      for bucket in spec.buckets]
    except UnknownRelease as exc:
        raise NotTheSpec(f"{manifest.key} cannot be checked against the spec: this client's release table does not "
                         f"know its SDK ({exc}); upgrade compilesvc, or fetch the artifact by its key") from None
    except ValueError as exc:
        raise NotTheSpec(f"{manifest.key} ({source}) is not the spec's artifact: {exc}") from None
    key = artifact_key_of(expected, [bucket_key_of(expected, bucket) for bucket in inputs])
    if key == manifest.key:
        return
    differ = _differences(expected, signed)
    signed_inputs = sorted(json.dumps(b.inputs, sort_keys=True) for b in manifest.buckets)
    if sorted(json.dumps(b, sort_keys=True) for b in inputs) != signed_inputs:
        differ.append("buckets")
    raise NotTheSpec(f"{manifest.key} ({source}) is a validly signed artifact, but not this spec's: its signed key "
                     f"material differs in {', '.join(differ) or 'its key'}; the spec's key would be {key}")


def _differences(expected: dict[str, Any], signed: dict[str, Any]) -> list[str]:
    """The material's parts that differ, one level into the toolchain and the model (``toolchain.target``)."""
    differ = []
    for name in sorted(set(expected) | set(signed)):
        mine, theirs = expected.get(name), signed.get(name)
        if mine == theirs:
            continue
        if isinstance(mine, dict) and isinstance(theirs, dict):
            parts = sorted(set(mine) | set(theirs))
            differ += [f"{name}.{part}" for part in parts if mine.get(part) != theirs.get(part)]
        else:
            differ.append(name)
    return differ
