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

import hashlib
import json
import os
import re
import shlex
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_neuronx
from _release import (
    COMPILE_CACHE_SINCE,
    COMPILER_FLAG_HOOK_SINCE,
    MODEL_BUILDER_SINCE,
    NXD_LNC_ENV,
    behaviour_from,
    current,
    device_count,
)

#: The one-process ModelBuilder (mock_distributed) ships from SDK 2.21.0 (neuronx-distributed 0.10.0).
ONE_PROCESS_SINCE = (2, 21, 0)
#: safetensors' dtype names (huggingface/safetensors README, "Format").
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}

#: model_builder_utils.py ``ModelBuilderConstants.LOG_FILE_DEFAULT_NAME``.
LOG_FILE_DEFAULT_NAME = "log-neuron-cc.txt"
#: The persistent cache's default location and its settings (aws-neuron-sdk about-neuron/arch/neuron-features/
#: neuron-caching.rst: "The default cache path is the directory /var/tmp/neuron-compile-cache"; "--cache_dir
#: ... via NEURON_CC_FLAGS or NEURON_COMPILE_CACHE_URL"; "--cache_dir is prioritized over ...
#: NEURON_COMPILE_CACHE_URL if both are set").
DEFAULT_CACHE_DIR = "/var/tmp/neuron-compile-cache"
CACHE_URL_ENV = "NEURON_COMPILE_CACHE_URL"
#: Test knob (not the SDK's): a file whose absence makes the ``corrupt-cache`` behaviour plant a corrupt entry,
#: and which the double then creates, so the corruption is met once across attempts (a compile sandbox must
#: see the file: tests using it run unsandboxed).
CORRUPT_ONCE_ENV = "COMPILESVC_NEURON_DOUBLE_CORRUPT_CACHE_ONCE"
#: How neuronx-cc reports an unreadable cache entry: a bare NLA001 around nlohmann::json's parse error
#: (aws-neuron-sdk tools/neuron-agentic-development/developer_guides/neuron-framework-autoport.rst,
#: "Compilation failures": "JSON parse error ([NLA001] Unhandled exception with message:
#: [json.exception.parse_error.101]). Delete the compiler cache at /var/tmp/neuron-compile-cache and retry.").
#: The text after the code is nlohmann::json's wording for an empty document (unverified against a real host).
CORRUPT_CACHE_ERROR = ("[NLA001] Unhandled exception with message: [json.exception.parse_error.101] parse error at "
                       "line 1, column 1: syntax error while parsing value - unexpected end of input; expected "
                       "'[', '{', or a literal")

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
        # ModelBuilder never splits the flags: it appends to the string (" --logfile=…", " --enable-internal-neff-
        # wrapper"), logs it ("Neuron compiler flags: …", neuronx_distributed/trace/model_builder.py at v2.27.0,
        # lines 642-645 and 720-733) and hands it to libneuronxla's neuron_xla_compile(compiler_flags=<str>).
        # libneuronxla splits a str the way a shell would: its own warning says str flags go through "repeated
        # joining and splitting" (libneuronxla/neuron_cc_wrapper.py:246, quoted in vllm-project/vllm-neuron#7),
        # and NxDI passes single-quoted values holding spaces through this very path
        # ("--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 '",
        # neuronx_distributed_inference/models/model_wrapper.py). The only whitespace split in NxD is
        # compile_wlo's (trace/functions.py:583 at v2.27.0, ``compiler_args.split()``), which ModelBuilder.trace
        # does not call. libneuronxla's exact splitter is closed source: shlex's is the one its users rely on.
        workdir = Path(self.compiler_workdir) / key / f"_tp0_bk{bucket_rank}"
        if "--logfile" not in flags:
            # model_builder.py (since 2.21, commit 3aa65c6): each bucket's compiler log goes to its output
            # directory, by absolute path, and the flags (log path included) are hashed into the cache key.
            flags += f" --logfile={(workdir / LOG_FILE_DEFAULT_NAME).absolute()}"
        print(f"[neuronx_distributed TEST DOUBLE] Neuron compiler flags: {flags}", flush=True)
        args = shlex.split(flags)
        target = torch_neuronx._target_arg(args) or torch_neuronx.PLATFORM_TARGET
        if target is None:
            raise RuntimeError(torch_neuronx.CPU_TARGET_ERROR)
        print(f"[neuronx_distributed TEST DOUBLE] ModelBuilder tracing {key} bucket {bucket_rank} for "
              f"tp_degree={self.tp_degree} world_size={self.world_size} target={target} "
              f"logical_nc_config={self.logical_nc_config}", flush=True)
        inputs = container.example_inputs[bucket_rank]
        # The process groups are laid out for logical_nc_config (model_builder.py at Release 2.29: trace()
        # calls parallel_state.initialize_model_parallel(..., lnc_size=self.logical_nc_config)), and the main
        # compile gets only the caller's flags: ModelBuilder adds --lnc itself only to its weight-layout compile
        # (" --lnc={self.logical_nc_config}"). The compiler therefore runs at its own default unless told: the
        # double hands logical_nc_config to its neuronx-cc, which records both in the NEFF.
        compiler_env = {NXD_LNC_ENV: str(self.logical_nc_config)}
        if current().tuple < COMPILE_CACHE_SINCE:
            return torch_neuronx._trace(model, inputs, workdir, args, target, compiler_env=compiler_env)
        return _compile_with_cache(model, inputs, workdir, flags, args, target, compiler_env)

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


# -- the persistent compile cache (ModelBuilder from 2.23) ------------------------------------------------

def cache_url() -> str:
    """Where ``neuron_xla_compile(use_cache=True, cache_dir=None)`` puts entries: ``--cache_dir`` in
    NEURON_CC_FLAGS, else NEURON_COMPILE_CACHE_URL, else the default (neuron-caching.rst, above; the same
    order as libneuronxla's ``CacheUrl.get_cache_url(cache_dir=None)`` per huggingface/optimum-neuron
    optimum/neuron/cache/AGENTS.md, "Path Resolution")."""
    found = None
    words = shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
    for index, word in enumerate(words):
        if word.startswith("--cache_dir="):
            found = word.partition("=")[2]
        elif word == "--cache_dir" and index + 1 < len(words):
            found = words[index + 1]
    return found or os.environ.get(CACHE_URL_ENV) or DEFAULT_CACHE_DIR


def _module_hash(hlo_text: str, flags: str) -> str:
    """model_builder.py ``get_hash_module``: sha256 of the module's text and the flags without spaces, 20 hex
    digits. The flags hold ``--logfile=<absolute path>``: another work directory is another key."""
    return hashlib.sha256((hlo_text + flags.replace(" ", "")).encode("utf-8")).hexdigest()[:20]


def _compile_with_cache(model: Any, inputs: Any, workdir: Path, flags: str, args: list[str], target: str,
                        compiler_env: dict[str, str]) -> Any:
    """``neuron_xla_compile(use_cache=True, retry_failed_compilation=False, ...)`` as ModelBuilder calls it.

    Entry layout (optimum-neuron cache/AGENTS.md, "Directory Layout"): ``<cache>/neuronxcc-<version>/
    MODULE_<hash>+<flags hash>/`` holding ``model.hlo_module.pb``, ``compile_flags.json``, ``model.neff`` and
    ``model.done`` after a success, ``model.log`` after a failure, and ``model.hlo_module.pb.lock`` while a
    compile runs. A done entry is reused ("Using a cached neff at ..."); a failed one is not recompiled ("Got
    a cached failed neff ... Will skip compilation, please set --retry_failed_compilation", neuron-caching.rst);
    an unreadable ``compile_flags.json`` fails with :data:`CORRUPT_CACHE_ERROR`.
    """
    import torch

    release = current()
    root = Path(cache_url())
    print(f"INFO ||NCC_WRAPPER||: Compile cache path: {root}", flush=True)
    with torch.no_grad():
        hlo_text = str(torch.jit.trace(model, inputs if isinstance(inputs, tuple) else (inputs,)).inlined_graph)
    flags_hash = hashlib.md5(flags.encode()).hexdigest()[:8]  # a name only, as the SDK's "+d41d8cd9"
    entry = (root / f"neuronxcc-{release.neuronx_cc}+{release.build_hash}"
             / f"MODULE_{_module_hash(hlo_text, flags)}+{flags_hash}")
    entry.mkdir(parents=True, exist_ok=True)
    settings = entry / "compile_flags.json"
    if behaviour_from(args) == "corrupt-cache":
        marker = os.environ.get(CORRUPT_ONCE_ENV)
        if not marker or not Path(marker).exists():
            settings.write_text("")  # a half-written entry, as an interrupted compile leaves one
            if marker:
                Path(marker).touch()
    if settings.exists():
        try:
            json.loads(settings.read_text())
        except ValueError:
            print(CORRUPT_CACHE_ERROR, flush=True)
            raise RuntimeError(CORRUPT_CACHE_ERROR) from None
    if (entry / "model.done").exists() and (entry / "model.neff").exists():
        print(f"INFO ||NCC_WRAPPER||: Using a cached neff at {entry / 'model.neff'}. Exiting with a successfully "
              f"compiled graph.", flush=True)
        return torch_neuronx._trace(model, inputs, workdir, args, target, compile_neff=False,
                                    compiler_env=compiler_env)
    if (entry / "model.log").exists():
        message = (f"Got a cached failed neff at {entry / 'model.neff'}. Will skip compilation, please set "
                   f"--retry_failed_compilation for recompilation.")
        print(f"INFO ||NCC_WRAPPER||: {message}", flush=True)
        raise RuntimeError(message)
    (entry / "model.hlo_module.pb").write_text(hlo_text)
    settings.write_text(json.dumps(flags.split()))
    lock = entry / "model.hlo_module.pb.lock"
    lock.touch()
    try:
        traced = torch_neuronx._trace(model, inputs, workdir, args, target, compiler_env=compiler_env)
    except Exception as exc:
        (entry / "model.log").write_text(f"{type(exc).__name__}: {exc}\n")
        raise
    finally:
        lock.unlink(missing_ok=True)
    neffs = sorted(workdir.rglob("graph.neff"))
    (entry / "model.neff").write_bytes(neffs[-1].read_bytes() if neffs else b"")
    (entry / "model.done").touch()
    return traced
