"""TEST DOUBLE of ``neuronx_distributed_inference.modules.checkpoint.load_state_dict``. Not the real SDK.

NXDI@ef2731e src/neuronx_distributed_inference/modules/checkpoint.py:L25-L68: the HF formats tried in order
(model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json; the
diffusers names are left out), else ``FileNotFoundError("Can not find model.safetensors or pytorch_model.bin
in <dir>")``. Reads with safetensors and torch, as the real one.
"""

from __future__ import annotations

import json
import os

import torch


def load_state_dict(state_dict_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = os.path.join(state_dict_dir, "model.safetensors")
    index = os.path.join(state_dict_dir, "model.safetensors.index.json")
    pickle = os.path.join(state_dict_dir, "pytorch_model.bin")
    pickle_index = os.path.join(state_dict_dir, "pytorch_model.bin.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        return _sharded(state_dict_dir, index, load_file)
    if os.path.isfile(pickle):
        return torch.load(pickle, map_location="cpu", weights_only=True)
    if os.path.isfile(pickle_index):
        return _sharded(state_dict_dir, pickle_index,
                        lambda path: torch.load(path, map_location="cpu", weights_only=True))
    raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {state_dict_dir}")


def _sharded(directory: str, index: str, load: object) -> dict[str, torch.Tensor]:
    with open(index) as handle:
        files = sorted(set(json.load(handle)["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load(os.path.join(directory, name)))  # type: ignore[operator]
    return state
