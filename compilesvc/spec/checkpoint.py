"""A Hugging Face checkpoint directory as the key sees it: its ``config.json`` (canonical) and, when the compile
writes pre-sharded weights, the digests of its weight files; and what such a directory must hold.

Owns :class:`CheckpointMaterial`, :func:`canonical_config`, the weight layouts NxD Inference reads
(:data:`WEIGHT_LAYOUTS`) and :func:`checkpoint_files`, which names the files of a directory listing the key and the
compile need, or raises :class:`CheckpointError` saying what is missing. Pure: the listing and the file contents
come from :mod:`compilesvc.pinning.checkpoints`, which reads archives, S3 prefixes and directories.
"""

from __future__ import annotations

import json
import posixpath
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
#: ``(file, is_index)``: NXDI@ef2731e src/neuronx_distributed_inference/modules/checkpoint.py:L49-L64 (names at
#: L10-L16; the same order since v0.4.7422, SDK 2.24). The diffusers names are tried before the index and the pickle
#: files: a ``diffusion_pytorch_model.safetensors`` beside an index is what NxDI reads, so the key must hash it.
#: An index (``weight_map``: tensor name -> shard file) brings the shards it names.
WEIGHT_LAYOUTS: tuple[tuple[str, bool], ...] = (
    ("model.safetensors", False),
    ("diffusion_pytorch_model.safetensors", False),
    ("model.safetensors.index.json", True),
    ("diffusion_pytorch_model.safetensors.index.json", True),
    ("pytorch_model.bin", False),
    ("pytorch_model.bin.index.json", True),
)
#: Before NxDI 0.4 (v0.1.0 to v0.3.5591, SDK 2.21-2.23) the loader knew no diffusers names:
#: NXDI@v0.1.0 src/neuronx_distributed_inference/modules/checkpoint.py:L39-L54.
WEIGHT_LAYOUTS_BEFORE_0_4: tuple[tuple[str, bool], ...] = tuple(
    (name, is_index) for name, is_index in WEIGHT_LAYOUTS if not name.startswith("diffusion_"))
#: Every file name a layout starts from (an index's shards aside), in NxDI's current order.
WEIGHT_FILES: tuple[str, ...] = tuple(name for name, _ in WEIGHT_LAYOUTS)


def weight_layouts(nxdi_version: str | None) -> tuple[tuple[str, bool], ...]:
    """The loader order of NxDI ``nxdi_version`` (a release's neuronx-distributed-inference; None: the newest)."""
    if nxdi_version is None:
        return WEIGHT_LAYOUTS
    try:
        major_minor = tuple(int(part) for part in nxdi_version.split(".")[:2])
    except ValueError:
        return WEIGHT_LAYOUTS
    return WEIGHT_LAYOUTS_BEFORE_0_4 if major_minor < (0, 4) else WEIGHT_LAYOUTS


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


def weight_layout(names: Iterable[str], layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS
                  ) -> tuple[str, bool]:
    """The layout NxDI would read from a directory holding ``names`` (relative paths), or :class:`CheckpointError`."""
    present = set(names)
    for name, is_index in layouts:
        if name in present:
            return name, is_index
    raise CheckpointError("the checkpoint has config.json but no weights beside it: NxD Inference reads one of "
                          f"{', '.join(name for name, _ in layouts)}")


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


def checkpoint_files(names: Iterable[str], read: Callable[[str], bytes],
                     layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS, *,
                     shards_of: Callable[[str], list[str]] | None = None) -> list[str]:
    """The weight files of a checkpoint directory listing ``names`` (paths relative to its root): the layout's
    file and, for an index, every shard it names. ``read(name)`` returns a small file's bytes (the index);
    ``layouts`` is the loader order of the NxDI release that compiles (:func:`weight_layouts`); ``shards_of``,
    when given, is what :func:`index_shards` once found in an index (a remembered reading), and ``read`` unused.

    Raises :class:`CheckpointError` when config.json, the weights or a shard an index names is missing.
    """
    present = set(names)
    if CONFIG_NAME not in present:
        raise CheckpointError("the checkpoint has no config.json at its root")
    name, is_index = weight_layout(present, layouts)
    if not is_index:
        return [name]
    shards = shards_of(name) if shards_of is not None else index_shards(read(name), name)
    missing = [shard for shard in shards if shard not in present]
    if missing:
        raise CheckpointError(f"{name} names shards the checkpoint lacks: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return [name, *shards]


def archive_member_path(name: str, *, regular: bool, directory: bool) -> str | None:
    """The checkpoint-relative path of a checkpoint archive's member ``name`` (``posixpath.normpath``-ed, so
    ``top/./config.json`` is ``top/config.json``), None for a directory, or :class:`CheckpointError` for a member
    that could make the compile read another file than the key did: a link (symbolic or hard: the key would hash
    the link, the compile read its target), a device or FIFO, an absolute or ``..`` path. Submit (pinning) and the
    worker's extraction apply the same rule, and both refuse a second member of one path (:func:`add_member`)."""
    path = posixpath.normpath(name)
    if name.startswith("/") or path == ".." or path.startswith("../"):
        raise CheckpointError(f"archive member {name!r} points outside the archive root")
    if directory:
        return None
    if not regular or path == ".":
        raise CheckpointError(f"archive member {name!r} is not a regular file (links, devices and FIFOs are "
                              "refused in a checkpoint archive: the compile would read another file than the key)")
    return path


def add_member(seen: set[str], path: str, name: str) -> None:
    """Record ``path`` (from :func:`archive_member_path`) in ``seen``; :class:`CheckpointError` when another member
    already had it: tar extraction keeps the last copy, a reader of the listing may keep the first."""
    if path in seen:
        raise CheckpointError(f"archive member {name!r} is a second copy of {path!r} (a checkpoint archive holds "
                              "each file once)")
    seen.add(path)
