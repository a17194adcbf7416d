"""A Hugging Face checkpoint directory as the key sees it: its ``config.json`` (canonical) and, when the compile
writes pre-sharded weights, the digests of its weight files; and what such a directory must hold.

Owns :class:`CheckpointMaterial`, :func:`canonical_config`, the weight layouts NxD Inference reads
(:data:`WEIGHT_LAYOUTS`) and :func:`checkpoint_files`, which names the files of a directory listing the key and the
compile need, or raises :class:`CheckpointError` saying what is missing. Pure: the listing and the file contents
come from :mod:`compilesvc.pinning.checkpoints`, which reads archives, S3 prefixes and directories.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

CONFIG_NAME = "config.json"
#: A config.json is a few KiB (a 405B model's is under 2 KiB); anything near this is not a model config, and is
#: refused before it is read into memory.
CONFIG_MAX_BYTES = 4 * 1024**2
#: An index is one line per tensor name (a 70B model's is about 70 KiB).
INDEX_MAX_BYTES = 64 * 1024**2

#: Attributes ``config.json`` carries that say where and with what it was written, not what is compiled: the path
#: the checkpoint was loaded from and the transformers version that saved it. transformers' ``from_pretrained``
#: sets ``_name_or_path`` to the path it was given, and NxDI copies the whole HF config into the InferenceConfig
#: it serialises (docs/research/nxdi.md §1 "Paths in the config", Open question 3: NXDI@ef2731e
#: src/neuronx_distributed_inference/utils/hf_adapter.py:L49-L76, models/config.py:L942-L944). Two copies of one
#: checkpoint at two paths, or a fine-tune saved by a newer transformers, would otherwise be two keys for one
#: compile.
NON_MATERIAL_CONFIG_FIELDS = frozenset({"_name_or_path", "transformers_version"})

#: The weight files NxDI's checkpoint loader looks for, in its order (the first present wins), as
#: ``(file, is_index)``: NXDI@ef2731e src/neuronx_distributed_inference/modules/checkpoint.py:L36-L68
#: (docs/research/nxdi.md §8; the diffusion_pytorch_model.* names it also tries are diffusion models', not LLMs').
#: An index (``weight_map``: tensor name -> shard file) brings the shards it names.
WEIGHT_LAYOUTS: tuple[tuple[str, bool], ...] = (
    ("model.safetensors", False),
    ("model.safetensors.index.json", True),
    ("pytorch_model.bin", False),
    ("pytorch_model.bin.index.json", True),
)


class CheckpointError(ValueError):
    """A checkpoint directory NxDI could not compile or load: what it lacks, in words for the spec's author."""


@dataclass(frozen=True)
class CheckpointMaterial:
    """What the key takes from a checkpoint: its ``config.json`` as read (canonicalised by the key) and, only when
    the compile writes pre-sharded weights, ``{relative path: sha256}`` of its weight files."""

    config: dict[str, Any]
    weights: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"config": self.config, "weights": self.weights}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMaterial:
        weights = data.get("weights")
        return cls(dict(data["config"]), None if weights is None else {str(k): str(v) for k, v in weights.items()})


def canonical_config(config: dict[str, Any], *, dtype_alias: bool = False) -> dict[str, Any]:
    """``config`` as key material: without :data:`NON_MATERIAL_CONFIG_FIELDS` (every other attribute is read by
    the model class NxDI builds from it). Key order does not matter: keys are hashed as canonical JSON.

    With ``dtype_alias`` (an NxDI that reads ``dtype`` before ``torch_dtype``, and pops both: NXDI@v0.7.14366
    src/neuronx_distributed_inference/utils/hf_adapter.py:L56, ef2731e L59-L67; SDK 2.27 on), transformers 4.56+'s
    ``dtype`` is written ``torch_dtype``, ``dtype`` winning when both are given as NxDI and transformers take it.
    Older NxDI reads ``torch_dtype`` alone, and what ``dtype`` does there depends on the transformers installed:
    the two stay apart. The value is kept as written: transformers turns it into a torch dtype with
    ``getattr(torch, value)``, so ``"torch.bfloat16"`` does not load (transformers 4.57 configuration_utils.py
    L269-L274) and must not share a key with ``"bfloat16"``."""
    out = {name: value for name, value in config.items() if name not in NON_MATERIAL_CONFIG_FIELDS}
    if dtype_alias and "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


def parse_config(data: bytes, where: str) -> dict[str, Any]:
    """A ``config.json``'s bytes as a JSON object, or :class:`CheckpointError` naming ``where`` it came from."""
    if len(data) > CONFIG_MAX_BYTES:
        raise CheckpointError(f"{where} is larger than {CONFIG_MAX_BYTES // 1024**2} MiB: not a model config")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{where} is not a JSON object")
    architectures = document.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        # NxDI's model class is chosen by architecture; vllm-neuron refuses a config without one
        # ("No architectures specified in the pretrained config.", docs/research/nxdi.md §8).
        raise CheckpointError(f"{where} names no architectures (e.g. \"architectures\": [\"LlamaForCausalLM\"])")
    return document


def weight_layout(names: Iterable[str]) -> tuple[str, bool]:
    """The layout NxDI would read from a directory holding ``names`` (relative paths), or :class:`CheckpointError`."""
    present = set(names)
    for name, is_index in WEIGHT_LAYOUTS:
        if name in present:
            return name, is_index
    raise CheckpointError("the checkpoint has config.json but no weights beside it: NxD Inference reads one of "
                          f"{', '.join(name for name, _ in WEIGHT_LAYOUTS)}")


def index_shards(data: bytes, where: str) -> list[str]:
    """The shard files an index (``*.index.json``) names in its ``weight_map``."""
    if len(data) > INDEX_MAX_BYTES:
        raise CheckpointError(f"{where} is larger than {INDEX_MAX_BYTES // 1024**2} MiB")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {exc}") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{where} has no weight_map of tensor names to shard files")
    return sorted(set(weight_map.values()))


def checkpoint_files(names: Iterable[str], read: Callable[[str], bytes]) -> list[str]:
    """The weight files of a checkpoint directory listing ``names`` (paths relative to its root): the layout's
    file and, for an index, every shard it names. ``read(name)`` returns a small file's bytes (the index).

    Raises :class:`CheckpointError` when config.json, the weights or a shard an index names is missing.
    """
    present = set(names)
    if CONFIG_NAME not in present:
        raise CheckpointError("the checkpoint has no config.json at its root")
    name, is_index = weight_layout(present)
    if not is_index:
        return [name]
    shards = index_shards(read(name), name)
    missing = [shard for shard in shards if shard not in present]
    if missing:
        raise CheckpointError(f"{name} names shards the checkpoint lacks: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return [name, *shards]
