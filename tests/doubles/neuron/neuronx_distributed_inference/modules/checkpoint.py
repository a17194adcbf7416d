"""TEST DOUBLE of ``neuronx_distributed_inference.modules.checkpoint.load_state_dict``. Not the real SDK.

NXDI@ef2731e src/neuronx_distributed_inference/modules/checkpoint.py:L24-L70: the HF formats tried in order
(model.safetensors, diffusion_pytorch_model.safetensors, model.safetensors.index.json,
diffusion_pytorch_model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json; file names at
L10-L16), else ``FileNotFoundError("Can not find model.safetensors or pytorch_model.bin in <dir>")``. Reads with
safetensors and torch, as the real one. (NxDI before 0.4.7422 lacks the two diffusers names: NXDI@v0.1.0 L39-L54.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from _release import current


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def load_state_dict(state_dict_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    # (file, is an index, loader), in NxDI's order: the first present wins.
    order: tuple[tuple[str, bool, Callable[[str], dict[str, torch.Tensor]]], ...] = (
        ("model.safetensors", False, load_file),
        ("diffusion_pytorch_model.safetensors", False, load_file),
        ("model.safetensors.index.json", True, load_file),
        ("diffusion_pytorch_model.safetensors.index.json", True, load_file),
        ("pytorch_model.bin", False, _torch_load),
        ("pytorch_model.bin.index.json", True, _torch_load),
    )
    before_0_4 = tuple(int(p) for p in (current().nxdi or "0.0").split(".")[:2]) < (0, 4)
    for name, is_index, load in order:
        if before_0_4 and name.startswith("diffusion_"):
            continue  # NXDI@v0.1.0 modules/checkpoint.py:L39-L54 knows no diffusers names
        path = os.path.join(state_dict_dir, name)
        if os.path.isfile(path):
            return _sharded(state_dict_dir, path, load) if is_index else load(path)
    raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {state_dict_dir}")


def _sharded(directory: str, index: str, load: Callable[[str], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    with open(index) as handle:
        files = sorted(set(json.load(handle)["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load(os.path.join(directory, name)))
    return state
