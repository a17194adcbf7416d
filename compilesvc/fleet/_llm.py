"""An LLM artifact as a serving host holds it: NxD Inference's compiled directory, verified in the cache.

An NxDI compile is one bucket (position 0, no inputs) whose files are the directory
``model.compile(compiled_model_path)`` writes: ``model.pt`` (every submodel and bucket), ``neuron_config.json``
(the whole InferenceConfig) and, when the compile pre-sharded the weights,
``weights/tp{rank}_sharded_checkpoint.safetensors``. The cache lays that bucket out as
``<cache>/v1/artifacts/<key>/bucket-0/``, which is exactly what vLLM's ``NEURON_COMPILED_ARTIFACTS`` names.

This module reads that directory (no torch, no NxDI); :mod:`compilesvc.fleet._serving` compares it with
vLLM's serving arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from compilesvc.fleet._remote import FleetError

#: NxDI's file names (aws-neuron/neuronx-distributed-inference@ef2731e
#: src/neuronx_distributed_inference/models/config.py:L23 ``CONFIG_FILE = "neuron_config.json"``;
#: models/application_base.py:L47 ``COMPILED_MODEL_FILE_NAME = "model.pt"``; L389-L399 the pre-sharded files).
NEURON_CONFIG_FILE = "neuron_config.json"
COMPILED_MODEL_FILE = "model.pt"
SHARDED_CHECKPOINT = "weights/tp{rank}_sharded_checkpoint.safetensors"


class NotAnLLMArtifact(FleetError):
    """The artifact is not an NxD Inference compile (no single bucket holding model.pt and neuron_config.json)."""


class NeuronConfigUnreadable(FleetError):
    """The artifact's neuron_config.json is not the InferenceConfig document NxDI writes."""


@dataclass(frozen=True)
class LLMArtifact:
    """NxDI's compiled directory (``directory``: what ``NEURON_COMPILED_ARTIFACTS`` points at) and the
    InferenceConfig NxDI wrote into it (``config``)."""

    key: str
    directory: Path
    config: dict[str, Any]
    files: tuple[str, ...]

    @classmethod
    def from_directory(cls, directory: Path, files: tuple[str, ...] | None = None, key: str = "") -> LLMArtifact:
        """The compiled directory at ``directory`` (``files``: its files as the manifest lists them; default:
        what is on disk)."""
        directory = Path(directory)
        if files is None:
            files = tuple(sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()))
        missing = [name for name in (COMPILED_MODEL_FILE, NEURON_CONFIG_FILE) if name not in files]
        if missing:
            raise NotAnLLMArtifact(f"{key or directory} is not an NxD Inference artifact: it has no "
                                   f"{' and no '.join(missing)} (files: {', '.join(files) or 'none'})")
        return cls(key, directory, read_inference_config(directory / NEURON_CONFIG_FILE), files)

    @property
    def compiled_model_path(self) -> Path:
        """The directory NxDI's ``load(compiled_model_path)`` and vLLM's ``NEURON_COMPILED_ARTIFACTS`` take."""
        return self.directory

    @property
    def neuron_config(self) -> dict[str, Any]:
        """The NeuronConfig member of the InferenceConfig (tp_degree, batch_size, seq_len, ...)."""
        member = self.config.get("neuron_config")
        assert isinstance(member, dict)  # read_inference_config checked it
        return member

    @property
    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config attributes NxDI copied into the InferenceConfig (everything but its own
        members)."""
        own = {"neuron_config", "fused_spec_config", "metadata"}
        return {k: v for k, v in self.config.items() if k not in own}

    @property
    def name_or_path(self) -> str | None:
        """``_name_or_path``: the checkpoint path the compile was given; NxDI reads the weights from it at load
        when it exists on the loading host (application_base.py:L633-L635)."""
        value = self.config.get("_name_or_path")
        return value if isinstance(value, str) and value else None

    @cached_property
    def presharded(self) -> bool:
        """Whether load() reads ``weights/tp{rank}_sharded_checkpoint.safetensors`` (save_sharded_checkpoint;
        application_base.py:L389-L399) rather than sharding the HF checkpoint (L404-L406)."""
        return bool(self.neuron_config.get("save_sharded_checkpoint"))

    def expected_shards(self) -> list[str]:
        """The pre-sharded files load() opens: one per rank ``start_rank_id .. +local_ranks_size-1``
        (application_base.py:L389-L399; local_ranks_size defaults to world_size = tp*pp*ep, config.py:L382-L384)."""
        nc = self.neuron_config
        start = int(nc.get("start_rank_id") or 0)
        count = nc.get("local_ranks_size") or nc.get("world_size") or nc.get("tp_degree") or 1
        return [SHARDED_CHECKPOINT.format(rank=rank) for rank in range(start, start + int(count))]

    def missing_shards(self) -> list[str]:
        return [name for name in self.expected_shards() if name not in self.files]


def read_inference_config(path: Path) -> dict[str, Any]:
    """``neuron_config.json`` as NxDI writes it: ``json.dumps(to_dict(InferenceConfig), indent=2, sort_keys=True)``
    (NXDI@ef2731e models/config.py:L942-L944): the HF config's attributes at the top level, the NeuronConfig
    under ``"neuron_config"`` (torch dtypes as strings, config.py:L62-L77)."""
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        raise NeuronConfigUnreadable(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise NeuronConfigUnreadable(f"{path} is not JSON: {exc}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("neuron_config"), Mapping):
        raise NeuronConfigUnreadable(f"{path} is not an NxD Inference InferenceConfig: it has no "
                                     "\"neuron_config\" object")
    return dict(document)
