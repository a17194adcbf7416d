"""TEST DOUBLE of ``neuronx_distributed.trace.model_builder`` (NxD's ModelBuilder). Not the real SDK.

Signatures from aws-neuron/neuronx-distributed src/neuronx_distributed/trace/model_builder.py (release
2.29): ``BaseModelInstance(module_cls, input_output_aliases)``; ``ModelBuilder(router, tp_degree,
checkpoint_loader, ..., compiler_workdir=None, ..., logical_nc_config=1, ..., compiler_flag_hook=None)``;
``add(key, model_instance, example_inputs, compiler_args=None, bucket_config=None, priority_model_idx=None)``
returning the builder; ``trace(initialize_model_weights=True, dry_run=False, disable_fail_fast=False)``
returning one TorchScript module (save it with ``torch.jit.save``); ``shard_checkpoint(serialize_path)``
writing ``tp<rank>_sharded_checkpoint.safetensors`` per rank. Behaviour mirrored:

- tracing happens in this one process with a mocked process group (no rank processes, no rendezvous
  port), and each (key, bucket) is compiled once for all ranks;
- compiler flags get the defaults of ``append_default_compiler_flags`` (``--auto-cast=none``, ``-O1``,
  ``--verbose=35`` when absent), then ``compiler_flag_hook(key, container, bucket_rank, flags)`` (2.26+);
- the platform target comes from ``--target`` in the flags, else the one frozen at import; no device is
  needed (aws-neuron-sdk#1303 cross-compiles NxD models with NEURON_PLATFORM_TARGET_OVERRIDE and no device).

- ``trace(initialize_model_weights=True)`` shards the checkpoint and loads it onto the Neuron runtime
  (``nxd_model.initialize``), which needs a device; a compile host without one passes False;
- ``shard_checkpoint`` writes safetensors files (the real module does ``from safetensors.torch import
  save_file`` at the top; neuronx-distributed's setup.py requires ``safetensors``). The double writes the
  same file format itself (see :func:`_save_safetensors`), so tests need no safetensors package;
- before 2.21 the real ModelBuilder spawned one process per rank with ``MASTER_PORT=2022`` hard-coded
  (commit 4f95471, SDK 2.20.0); it became one process under a mocked process group in 2.21 (commit 3aa65c6,
  ``mock_torchdist``). The double emulates only the later form and refuses to trace on 2.20.

Double limits: one key with one bucket per builder; weights are not sharded (each rank file holds the
whole checkpoint); the returned module is the traced model itself.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_neuronx
from _release import COMPILER_FLAG_HOOK_SINCE, MODEL_BUILDER_SINCE, NXD_LNC_ENV, current, device_count

#: The one-process ModelBuilder (mock_distributed) ships from SDK 2.21.0 (neuronx-distributed 0.10.0).
ONE_PROCESS_SINCE = (2, 21, 0)
#: safetensors' dtype names (huggingface/safetensors README, "Format").
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}

if current().tuple < MODEL_BUILDER_SINCE:  # the module does not exist in older neuronx-distributed
    raise ModuleNotFoundError("No module named 'neuronx_distributed.trace.model_builder'")


def append_default_compiler_flags(compiler_args: str | None = "") -> str:
    """The real defaults (model_builder.py ``append_default_compiler_flags``)."""
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    if not re.search(r"-O\d+", compiler_args):
        compiler_args += " -O1 "
    if "--verbose" not in compiler_args:
        compiler_args += " --verbose=35"
    return compiler_args


class BaseModelInstance:
    def __init__(self, module_cls: Callable[[], torch.nn.Module], input_output_aliases: dict[Any, Any]):
        self.module_cls = module_cls
        self.module: torch.nn.Module | None = None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self) -> None:
        self.module = self.module_cls()

    def get(self, bucket_rank: int, **kwargs: Any) -> tuple[torch.nn.Module | None, dict[Any, Any]]:
        return self.module, self.input_output_aliases[0]


class ModelContainer:
    def __init__(self, model_instance: BaseModelInstance, example_inputs: list[tuple[torch.Tensor, ...]],
                 compiler_args: str, bucket_config: Any, priority_model_idx: int | None):
        self.model_instance = model_instance
        self.example_inputs = example_inputs
        self.compiler_args = compiler_args
        self.bucket_config = bucket_config
        self.priority_model_idx = priority_model_idx


class ModelBuilder:
    def __init__(self, router: Any, tp_degree: int, checkpoint_loader: Callable[[], dict[str, torch.Tensor]],
                 start_rank_id: int = 0, pp_degree: int = 1, ep_degree: int = 1, local_ranks_size: int | None = None,
                 world_size: int | None = None, compiler_workdir: str | None = None,
                 master_proc_env_vars: dict[str, str] | None = None, debug: bool = False, num_cores_per_group: int = 1,
                 init_custom_process_group_fn: Callable[[], None] | None = None, logical_nc_config: int = 1,
                 weights_to_skip_layout_optimization: set[str] | None = None,
                 compiler_flag_hook: Callable[..., str] | None = None):
        if compiler_flag_hook is not None and current().tuple < COMPILER_FLAG_HOOK_SINCE:
            raise TypeError("ModelBuilder.__init__() got an unexpected keyword argument 'compiler_flag_hook'")
        if world_size is None:
            world_size = tp_degree * pp_degree * ep_degree
        elif local_ranks_size is None:
            raise ValueError("`world_size` is specified, but `local_ranks_size` is None. Cannot determine "
                             "local_ranks_size.")
        self.router = router
        self.tp_degree = tp_degree
        self.world_size = world_size
        self.start_rank_id = start_rank_id
        self.local_ranks_size = local_ranks_size if local_ranks_size is not None else world_size
        self.checkpoint_loader = checkpoint_loader
        self.compiler_workdir = compiler_workdir or "/tmp/nxd_model/"
        self.master_proc_env_vars = master_proc_env_vars
        self.logical_nc_config = logical_nc_config
        self.compiler_flag_hook = compiler_flag_hook
        self.model_collection: dict[str, ModelContainer] = {}

    def add(self, key: str, model_instance: BaseModelInstance, example_inputs: list[tuple[torch.Tensor, ...]],
            compiler_args: str | None = None, bucket_config: Any = None,
            priority_model_idx: int | None = None) -> ModelBuilder:
        self.model_collection[key] = ModelContainer(model_instance, example_inputs,
                                                    append_default_compiler_flags(compiler_args), bucket_config,
                                                    priority_model_idx)
        return self

    def trace(self, initialize_model_weights: bool = True, dry_run: bool = False,
              disable_fail_fast: bool = False) -> Any:
        if current().tuple < ONE_PROCESS_SINCE:
            raise NotImplementedError("TEST DOUBLE: the SDK 2.20 ModelBuilder (one process per rank, rendezvous "
                                      "on port 2022) is not emulated")
        if initialize_model_weights and device_count() == 0:
            # nxd_model.initialize loads the weights through the Neuron runtime. The real message is
            # unverified; the PJRT client's no-device error stands in for it.
            raise RuntimeError(torch_neuronx.NO_DEVICE_ERROR)
        if self.master_proc_env_vars:
            os.environ.update(self.master_proc_env_vars)
        buckets = [(key, c, i) for key, c in self.model_collection.items() for i in range(len(c.example_inputs))]
        if len(buckets) != 1:
            raise NotImplementedError("TEST DOUBLE: ModelBuilder supports exactly one key with one bucket")
        key, container, bucket_rank = buckets[0]
        container.model_instance.load_module()
        model, _aliases = container.model_instance.get(bucket_rank)
        flags = container.compiler_args
        if self.compiler_flag_hook is not None:
            flags = self.compiler_flag_hook(key, container, bucket_rank, flags)
        # NxD takes the args as one string and splits it on whitespace, not as a shell would
        # (neuronx_distributed/trace/model_builder_utils.py: ``args_list = compiler_args.split()``): a quoted
        # value holding a space arrives cut in two, which is why compilesvc refuses such values for tp > 1.
        args = flags.split()
        target = torch_neuronx._target_arg(args) or torch_neuronx.PLATFORM_TARGET
        if target is None:
            raise RuntimeError(torch_neuronx.CPU_TARGET_ERROR)
        print(f"[neuronx_distributed TEST DOUBLE] ModelBuilder tracing {key} bucket {bucket_rank} for "
              f"tp_degree={self.tp_degree} world_size={self.world_size} target={target} "
              f"logical_nc_config={self.logical_nc_config}", flush=True)
        workdir = Path(self.compiler_workdir) / key / f"_tp0_bk{bucket_rank}"
        # The process groups are laid out for logical_nc_config (model_builder.py at Release 2.29: trace()
        # calls parallel_state.initialize_model_parallel(..., lnc_size=self.logical_nc_config)), and the main
        # compile gets only the caller's flags: ModelBuilder adds --lnc itself only to its weight-layout compile
        # (" --lnc={self.logical_nc_config}"). The compiler therefore runs at its own default unless told: the
        # double hands logical_nc_config to its neuronx-cc, which records both in the NEFF.
        return torch_neuronx._trace(model, container.example_inputs[bucket_rank], workdir, args, target,
                                    compiler_env={NXD_LNC_ENV: str(self.logical_nc_config)})

    def shard_checkpoint(self, serialize_path: str | None = None) -> list[dict[str, torch.Tensor]]:
        checkpoint = self.checkpoint_loader()
        shards = []
        for rank in range(self.start_rank_id, self.start_rank_id + self.local_ranks_size):
            shard = {name: tensor.contiguous() for name, tensor in checkpoint.items()}
            if serialize_path is not None:
                Path(serialize_path).mkdir(parents=True, exist_ok=True)
                _save_safetensors(shard, Path(serialize_path) / f"tp{rank}_sharded_checkpoint.safetensors")
            shards.append(shard)
        return shards


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """What ``safetensors.torch.save_file`` writes (huggingface/safetensors README, "Format"): an 8-byte
    little-endian header length, a JSON header mapping each name to dtype, shape and byte offsets into the
    data, padded with spaces to 8 bytes, then the tensors' bytes."""
    header: dict[str, Any] = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))
