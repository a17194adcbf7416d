"""TEST DOUBLE of ``neuronx_distributed.trace``: ``parallel_model_trace``/``_save``/``_load``. Not the real SDK.

The real ``parallel_model_trace`` starts one worker per rank, each calling ``func()`` for its own
``(model, states)`` and tracing it. This double does the same sequentially in-process with the
``torch_neuronx`` double, and saves rank ``r`` as ``<dir>/tp_<r>.pt``. There is no sharding: each rank
holds the whole model, and the assembled model runs rank 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_neuronx


class TensorParallelModel(torch.nn.Module):
    """The ranks' traced models; ``forward`` runs rank 0 (the double does not shard)."""

    def __init__(self, models: list[Any]):
        super().__init__()
        self.models = models

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.models[0](*inputs)


def parallel_model_trace(func: Callable[[], tuple[Any, dict[str, Any]]], example_inputs: Any,
                         compiler_workdir: str | os.PathLike[str] | None = None,
                         compiler_args: str | list[str] | None = None, inline_weights_to_neff: bool = True,
                         bucket_config: Any = None, tp_degree: int = 1,
                         max_parallel_compilations: int | None = None) -> TensorParallelModel:
    """Trace ``tp_degree`` ranks (TEST DOUBLE: sequentially, unsharded)."""
    models = []
    for rank in range(tp_degree):
        model, _states = func()
        workdir = Path(compiler_workdir or "neuron-compiler-workdir") / f"tp{rank}"
        print(f"[neuronx_distributed TEST DOUBLE] tracing rank {rank}/{tp_degree}", flush=True)
        models.append(torch_neuronx.trace(model, example_inputs, compiler_workdir=str(workdir),
                                          compiler_args=compiler_args))
    return TensorParallelModel(models)


def parallel_model_save(model: TensorParallelModel, path: str | os.PathLike[str]) -> None:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, traced in enumerate(model.models):
        torch.jit.save(traced, str(directory / f"tp_{rank}.pt"))


def parallel_model_load(path: str | os.PathLike[str]) -> TensorParallelModel:
    files = sorted(Path(path).glob("tp_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return TensorParallelModel([torch.jit.load(str(p)) for p in files])
