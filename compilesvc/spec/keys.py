"""Artifact keys: full SHA-256 over a canonical serialization of everything that changes compiler output.

A *bucket key* names one compile (one shape bucket); the *artifact key* names the set, derived from the
sorted, de-duplicated bucket keys plus the set-level fields. Both are versioned by :data:`KEY_SCHEMA`;
changing what goes into a key means bumping it. Labels, the model's display name, the URI spelling,
bucket order, dict order and the hash seed never reach the hash.

Every key carries its per-component digests (:attr:`KeySet.components`) so a cache miss can be explained
by diffing two keys' components (``compilesvc key SPEC --explain``).

An NxD Inference spec (backend ``nxdi``, an hf-checkpoint model) is keyed by what NxDI compiles from: the
checkpoint's canonical ``config.json``, the canonical NeuronConfig and the toolchain; its weights only when the
compile writes pre-sharded weights (docs/keys.md, "LLM checkpoints (NxD Inference)"). It is one compile: one
bucket key, with no inputs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from compilesvc.spec.checkpoint import CheckpointMaterial, canonical_config
from compilesvc.spec.compile_spec import ISA_RE, NEURON_TARGETS, CompileSpec
from compilesvc.spec.flags import canonical_flags
from compilesvc.spec.neuron_toolchain import toolchain_material
from compilesvc.spec.neuronx_cc_options import default_lnc, effective_lnc
from compilesvc.spec.nxdi_config import resolved_lnc
from compilesvc.spec.nxdi_fields import nxdi_release

KEY_SCHEMA = "compilesvc-key/5"

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

#: The set-level components of a key, in the order they are explained (neuron_config: nxdi keys only).
COMPONENTS = ("schema", "salt", "model", "toolchain", "neuron_config", "flags")


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8. The only serialization keys are made of."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


@dataclass(frozen=True)
class BucketKey:
    key: str
    inputs: list[dict[str, Any]]
    position: int  # index of the bucket in the spec as submitted (display only)


@dataclass(frozen=True)
class KeySet:
    """The keys of one spec, with the material and per-component digests behind them."""

    key: str
    buckets: list[BucketKey]
    material: dict[str, Any]
    components: dict[str, str] = field(default_factory=dict)

    @property
    def bucket_keys(self) -> list[str]:
        return sorted({b.key for b in self.buckets})

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "schema": KEY_SCHEMA,
            "buckets": [{"key": b.key, "inputs": b.inputs} for b in self.buckets],
            "components": self.components,
        }


def set_material(spec: CompileSpec, *, model_sha256: str, default_isa: str, salt: str = "") -> dict[str, Any]:
    """The set-level key material: everything in a key except a bucket's inputs.

    Raises ValueError for a ``model_sha256`` that is not a SHA-256 hex digest, an unusable ISA, or a Neuron
    release the release table does not know (:class:`compilesvc.spec.neuron_releases.UnknownRelease`).
    """
    # One spelling per digest: an upper-case hex digest of the same bytes must not make a second key.
    sha = model_sha256.lower()
    if not _SHA256_RE.match(sha):
        raise ValueError(f"model_sha256 must be 64 hex digits, got {model_sha256!r}")
    toolchain: dict[str, Any] = {
        "target": spec.target,
        "backend": spec.backend,
        "tp_degree": spec.compiler.tp_degree,
    }
    flags = canonical_flags(spec.compiler.args)
    if spec.target in NEURON_TARGETS:
        # The exact packages the release resolves to, not its label: releases shipping the same toolchain
        # share artifacts, and a table entry that changed would show as a changed key (docs/keys.md).
        toolchain["neuron"] = toolchain_material(spec.sdk, spec.backend, spec.compiler.tp_degree)
        # The logical NeuronCores the compile runs with, resolved here (the spec's --logical-nc-config, else
        # the target's default): the worker gives this one value to the compiler and to NxD, and a spec that
        # writes the default shares the key of one that omits it.
        toolchain["lnc"], flags = effective_lnc(spec.target, flags)
    else:
        toolchain["sdk"] = spec.sdk  # the cpu target's sdk is the exact torch version already
    if spec.backend == "aotinductor":
        isa = spec.compiler.isa or default_isa
        if not ISA_RE.fullmatch(isa):
            raise ValueError(f"ISA must look like <arch>-<level> (e.g. x86_64-avx512), got {isa!r}")
        toolchain["isa"] = isa
    return {
        "schema": KEY_SCHEMA,
        "salt": salt,
        "model": {"sha256": sha, "format": spec.model.format},
        "toolchain": toolchain,
        "flags": flags,
    }


#: The NxDI release columns whose hf_adapter reads config.json's ``torch_dtype`` only (NXDI@v0.1.0 … v0.6.10598
#: utils/hf_adapter.py:L52-L56); from v0.7.14366 (SDK 2.27) it reads ``dtype`` first (L56).
_TORCH_DTYPE_ONLY = frozenset({"2.21.0", "2.21.1", "2.22", "2.23", "2.24", "2.25", "2.26"})


def presharded(spec: CompileSpec) -> bool:
    """Whether an nxdi compile of ``spec`` writes pre-sharded weights (``weights/tp{rank}_sharded_checkpoint.
    safetensors``), so that its artifact depends on the weights' values: NeuronConfig ``save_sharded_checkpoint``
    as the canonical NeuronConfig resolves it (its default is the release's: True in 2.21-2.22, False from 2.23,
    docs/research/nxdi.md §2), unless ``skip_sharding`` (2.22+) stops ``shard_weights`` before it writes anything
    (NXDI@ef2731e models/application_base.py:L246-L248; v0.2.0 L159). The spec check refuses the combinations
    whose artifact could not load (:mod:`compilesvc.spec.nxdi_config`); this is what the compile writes."""
    config = spec.nxdi_config
    return bool(config.get("save_sharded_checkpoint")) and not config.get("skip_sharding")


def nxdi_material(spec: CompileSpec, checkpoint: CheckpointMaterial | None, salt: str) -> dict[str, Any]:
    """The key material of an NxD Inference compile (the contract of issue 29, docs/keys.md).

    The weights are in it only when the compile writes pre-sharded weights (:func:`presharded`): NxDI traces
    with ``initialize_model_weights=False`` and hands the weights to the compiled model at load time, so model.pt
    holds none (NXDI@ef2731e src/neuronx_distributed_inference/models/application_base.py:L302-L312, L404-L415;
    docs/research/nxdi.md §1). Raises ValueError without ``checkpoint`` (or without its weight digests when they
    are needed), and the release table's errors for a release that ships no NxDI.
    """
    if checkpoint is None:
        raise ValueError("an hf-checkpoint model is keyed by its config.json: pin the checkpoint first "
                         "(compute_keys(checkpoint=...))")
    weights: dict[str, str] | None = None
    if presharded(spec):
        if checkpoint.weights is None:
            raise ValueError("save_sharded_checkpoint puts the weights in the artifact: their digests are key "
                             "material, and the checkpoint was pinned without them")
        weights = dict(checkpoint.weights)
        for path, sha in weights.items():
            if not _SHA256_RE.match(sha):
                raise ValueError(f"weight digest of {path!r} must be 64 lowercase hex digits, got {sha!r}")
    neuron_config = spec.nxdi_config
    tp_degree = int(neuron_config.get("tp_degree", 1))
    toolchain: dict[str, Any] = {
        "target": spec.target,
        "backend": spec.backend,
        "tp_degree": tp_degree,
        "neuron": toolchain_material(spec.sdk, spec.backend, tp_degree),
        # The logical NeuronCores NxDI compiles with, as the canonical NeuronConfig resolved them for the release:
        # logical_nc_config (2.22+: given, else the target's, NXDI@ef2731e models/config.py:L729-L759), or 2.21's
        # logical_neuron_cores (default 1 on every target, passed as --internal-num-neuroncores-per-sengine:
        # NXDI@v0.1.0 models/model_wrapper.py:L121; docs/research/nxdi_compiler_args.md).
        "lnc": resolved_lnc(neuron_config),
    }
    return {
        "schema": KEY_SCHEMA,
        "salt": salt,
        "model": {"format": spec.model.format, "weights": weights,
                  "config": canonical_config(checkpoint.config, dtype_alias=nxdi_release(spec.sdk).column
                                             not in _TORCH_DTYPE_ONLY)},
        "toolchain": toolchain,
        "neuron_config": neuron_config,
        # NxDI derives its compiler flags from the NeuronConfig (docs/research/nxdi_compiler_args.md): the
        # NeuronConfig is in the key, so only the spec's own args (none, usually) are flags here.
        "flags": canonical_flags(spec.compiler.args),
    }


def shape_text(inputs: Iterable[dict[str, Any]]) -> str:
    """A bucket's inputs (as key material has them) for people: ``input_ids: int64[2, 128], mask: …``."""
    return ", ".join(f"{i.get('name')}: {i.get('dtype')}{list(i.get('shape', []))}" for i in inputs)


def bucket_key_of(material: dict[str, Any], inputs: list[dict[str, Any]]) -> str:
    """The bucket key of set-level ``material`` and one bucket's ``inputs``."""
    return digest({**material, "inputs": inputs})


def artifact_key_of(material: dict[str, Any], bucket_keys: list[str]) -> str:
    """The artifact key of set-level ``material`` and its bucket keys (in any order, repeats allowed)."""
    return digest({**material, "buckets": sorted(set(bucket_keys))})


def compute_keys(spec: CompileSpec, *, model_sha256: str, default_isa: str, salt: str = "",
                 checkpoint: CheckpointMaterial | None = None) -> KeySet:
    """Keys for ``spec`` whose model content hashes to ``model_sha256``.

    ``default_isa`` fills in the ISA of cpu aotinductor specs that do not name one. An nxdi spec needs its pinned
    ``checkpoint`` (its model sha256 is recorded with builds, but the key holds the config, and the weights only
    when pre-sharded): one bucket key, with no inputs, at position 0.
    """
    if spec.backend == "nxdi":
        if not _SHA256_RE.match(model_sha256.lower()):
            raise ValueError(f"model_sha256 must be 64 hex digits, got {model_sha256!r}")
        material = nxdi_material(spec, checkpoint, salt)
        buckets = [BucketKey(key=bucket_key_of(material, []), inputs=[], position=0)]
    else:
        material = set_material(spec, model_sha256=model_sha256, default_isa=default_isa, salt=salt)
        buckets = []
        for position, bucket in enumerate(spec.buckets):
            inputs = [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in bucket.inputs]
            buckets.append(BucketKey(key=bucket_key_of(material, inputs), inputs=inputs, position=position))
    bucket_keys = sorted({b.key for b in buckets})
    artifact_key = artifact_key_of(material, bucket_keys)
    components = {name: digest(material[name]) for name in COMPONENTS if name in material}
    components["buckets"] = digest(bucket_keys)
    return KeySet(key=artifact_key, buckets=buckets, material=material, components=components)


def explain(keys: KeySet) -> list[str]:
    """Human-readable lines: each component's digest and the value it was computed from."""
    lines = [f"artifact key  {keys.key}", f"schema        {keys.material['schema']}"]
    for name in COMPONENTS[1:]:
        if name not in keys.material:
            continue
        value = json.dumps(keys.material[name], sort_keys=True)
        lines.append(f"{name:<13} {keys.components[name][:16]}  {value}")
        toolchain = keys.material["toolchain"]
        if name == "toolchain" and "lnc" in toolchain:
            target, lnc = toolchain["target"], toolchain["lnc"]
            how, default, whose = "--logical-nc-config", default_lnc(target), f"{target}'s default"
            if "neuron_config" in keys.material:
                how = "logical_nc_config"
                if "logical_nc_config" not in keys.material["neuron_config"]:  # 2.21: 1 whatever the target
                    how, default, whose = "logical_neuron_cores", 1, "NxDI 2.21's default"
            why = whose if lnc == default else f"{how}; {whose} is {default}"
            lines.append(f"  lnc         {lnc}  (logical NeuronCores, resolved at submit: {why}; neuronx-cc and NxD "
                         f"both get it)")
        if name == "model" and "config" in keys.material["model"]:
            model = keys.material["model"]
            weights = model["weights"]
            lines.append(f"  config      {digest(model['config'])[:16]}  config.json without "
                         "_name_or_path and transformers_version")
            lines.append("  weights     " + ("not in the key: NxDI loads them at load time (shared by fine-tunes)"
                                            if weights is None else
                                            f"{len(weights)} files' sha256 (save_sharded_checkpoint)"))
    lines.append(f"{'buckets':<13} {keys.components['buckets'][:16]}  ({len(keys.bucket_keys)} unique)")
    for bucket in keys.buckets:
        shapes = ", ".join(f"{i['name']}:{i['dtype']}{i['shape']}" for i in bucket.inputs)
        lines.append(f"  bucket[{bucket.position}] {bucket.key}  {shapes or '(one NxDI compile: every bucket)'}")
    return lines
