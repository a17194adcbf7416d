"""TEST DOUBLE of ``neuronx_distributed_inference.models.application_base.NeuronApplicationBase``. Not the real SDK.

``compile(compiled_model_path)`` as NXDI@ef2731e src/neuronx_distributed_inference/models/application_base.py:
L292-L316 (same order in every tag, docs/research/nxdi.md §1): ``neuron_config.json`` first (L299), then the
trace with ``initialize_model_weights=False`` (L302-L305), the per-bucket configs in the work dir (L267-L290),
``model.pt`` by ``torch.jit.save`` (L312, ``COMPILED_MODEL_FILE_NAME`` L47), then ``shard_weights`` (L240-L265):
``weights/tp{rank}_sharded_checkpoint.safetensors`` only with save_sharded_checkpoint (else the log line
"SKIPPING pre-sharding the checkpoints. The checkpoints will be sharded during load time."). Only sharding
reads the checkpoint's weights (``checkpoint_loader_fn``, L630-L683: ``_name_or_path`` if it exists, else the
constructor's path; modules/checkpoint.py's FileNotFoundError when there are none): a shard-on-load compile
needs config.json alone.

The work dir is ``BASE_COMPILE_WORK_DIR`` (default ``/tmp/nxd_model/``, L150) and is wiped at each trace
(NXD@fbac349 src/neuronx_distributed/trace/model_builder.py:L543-L545); each bucket's HLO, NEFF and compiler log
go to ``<work dir>/<tag>/_tp0_bk<i>/`` (L717, L76-L79) and the NEFFs are read back from there into model.pt,
so two compiles sharing a work dir break each other as the real ones do.

Double limits: no real HLO or NEFF. A bucket's "NEFF" is a digest of what the compiler sees (the HF config
without ``_name_or_path``/``transformers_version``, the NeuronConfig, the submodel, the bucket, the flags, the
target, the LNC and the toolchain's versions), never of the weights (the real NEFFs take the weights as HLO
parameters: NXD@fbac349 model_builder.py:L904-L911). model.pt is a real TorchScript module holding them.
Time and memory are claimed by test knobs (:mod:`neuronx_distributed_inference.models._claims`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import time
from typing import Any

import torch
from _release import current, default_lnc, detected_platform

from neuronx_distributed_inference.models import _claims
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig, nxdi_minor, to_dict

COMPILED_MODEL_FILE_NAME = "model.pt"
logger = logging.getLogger("Neuron")
#: What torch_neuronx/libneuronxla saw as the platform when the Neuron libraries were imported: fixed then,
#: as in the SDK (optimum-neuron #961; docs/research/nxdi.md §6). A model whose flags carry no --target
#: (an overriding get_compiler_args) is compiled for it.
PLATFORM_AT_IMPORT: str | None = detected_platform()
#: neuronx-cc's text when it is killed for memory (docs/research/nxdi.md §6; aws-neuron-samples#64).
F137 = ("[F137] neuronx-cc was forcibly killed - This most commonly occurs due to insufficient system memory. "
        "Using a smaller data type, dimensions, batch size, or a larger instance type may help.")


def normalize_path(path: str) -> str:
    """L51-L54: normalised, with a trailing separator."""
    return os.path.join(os.path.normpath(path), "")


def is_compiled(model_path: str) -> bool:
    return os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)


class NxDModelDouble(torch.nn.Module):
    """What model.pt holds in the double: every submodel's bucket NEFFs and an index (JSON; its type is inferred,
    a class annotation would be a string under ``from __future__ import annotations``)."""

    def __init__(self, blob: bytes, index: str) -> None:
        super().__init__()
        self.index = index
        self.register_buffer("neffs", torch.frombuffer(bytearray(blob or b"\0"), dtype=torch.uint8).clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


class _Builder:
    """NxD's ModelBuilder as NxDI drives it (application_base.py:L146-L183), reduced to what compile does."""

    def __init__(self, app: NeuronApplicationBase, workdir: str) -> None:
        self.app = app
        self.compiler_workdir = workdir

    def trace(self, initialize_model_weights: bool = True, dry_run: bool = False) -> torch.nn.Module:
        assert not initialize_model_weights, "TEST DOUBLE: NxDI compiles with initialize_model_weights=False"
        if os.path.exists(self.compiler_workdir):  # NXD@fbac349 model_builder.py:L543-L545
            shutil.rmtree(self.compiler_workdir)
        app, neuron_config = self.app, self.app.neuron_config
        plan = [(tag, i, bucket, flags) for tag, buckets, flags in app.submodels() for i, bucket in enumerate(buckets)]
        need = _claims.memory_claim()
        for tag, i, bucket, _flags in plan:  # HLO generation, in this process (aws-neuron-sdk#1222's log line)
            logger.info(f"generating HLO: {tag}, input example shape = "
                        f"torch.Size([{neuron_config.batch_size}, {bucket}])")
            _claims.hlo_generation(need)
            bucket_dir = os.path.join(self.compiler_workdir, tag, f"_tp0_bk{i}", "model")
            os.makedirs(bucket_dir, exist_ok=True)
            with open(os.path.join(bucket_dir, "graph.hlo"), "w") as handle:
                handle.write(app.graph_description(tag, bucket))
        _claims.take_time()
        for tag, i, _bucket, flags in plan:
            bucket_dir = os.path.join(self.compiler_workdir, tag, f"_tp0_bk{i}")
            # NXD model_builder.py:L643-L644, L721-L722: the compiler's log file, by absolute path, in the flags.
            flags += f" --logfile={os.path.abspath(os.path.join(bucket_dir, 'log-neuron-cc.txt'))}"
            logger.info(f"Neuron compiler flags: {flags}")
            target = _target(flags)
            _claims.compiler(need, F137)
            with open(os.path.join(bucket_dir, "model", "graph.hlo")) as handle:
                hlo = handle.read()
            release = current()
            # The LNC the compiler was told (flags, else the environment, else its default for the target), next
            # to the one NxD laid the graph out for (the config's): they can differ when a model's flags override
            # omits --lnc (issue 41).
            neff = (b"NEFF\0TESTDOUBLE\n" + f"target={target}\nlnc={_compiled_lnc(flags, target)}\n"
                    f"nxd_logical_nc_config={neuron_config.logical_nc_config}\n"
                    f"neuronx_cc={release.neuronx_cc}\nflags={_without_logfile(flags)}\nhlo_sha256="
                    f"{hashlib.sha256(hlo.encode()).hexdigest()}\n".encode())
            with open(os.path.join(bucket_dir, "model", "graph.neff"), "wb") as handle:
                handle.write(neff)
            with open(os.path.join(bucket_dir, "log-neuron-cc.txt"), "w") as handle:
                handle.write(f"Compiler status PASS (TEST DOUBLE, target {target})\n")
        if dry_run:
            return NxDModelDouble(b"", "{}")
        blobs, index = [], {}
        for tag, i, _bucket, _flags in plan:  # read back, as ModelBuilder builds model.pt from the work dir
            with open(os.path.join(self.compiler_workdir, tag, f"_tp0_bk{i}", "model", "graph.neff"), "rb") as h:
                data = h.read()
            index[f"{tag}/_tp0_bk{i}"] = [sum(len(b) for b in blobs), len(data)]
            blobs.append(data)
        return torch.jit.script(NxDModelDouble(b"".join(blobs), json.dumps(index, sort_keys=True)))

    def shard_checkpoint(self, serialize_path: str) -> None:
        """NXD@fbac349 model_builder.py:L817-L858, L994-L1000: one safetensors file per local rank."""
        from safetensors.torch import save_file

        neuron_config = self.app.neuron_config
        checkpoint = self.app.checkpoint_loader_fn()
        os.makedirs(serialize_path, exist_ok=True)
        tp = neuron_config.tp_degree
        for rank in range(neuron_config.start_rank_id, neuron_config.start_rank_id + neuron_config.local_ranks_size):
            shard = {}
            for name, tensor in checkpoint.items():
                # Double: rows split over the tp ranks where they divide (the parallel layers' own rule differs).
                if tensor.dim() == 2 and tensor.shape[0] % tp == 0:
                    tensor = tensor.chunk(tp, dim=0)[rank % tp]
                shard[name] = tensor.contiguous()
            save_file(shard, os.path.join(serialize_path, f"tp{rank}_sharded_checkpoint.safetensors"))


def _compiled_lnc(flags: str, target: str) -> int:
    """The logical NeuronCore config neuronx-cc compiles for: ``--lnc``/``-lnc``/``--logical-nc-config`` in the
    flags (compiler CLI reference; the right-most wins), else ``NEURON_LOGICAL_NC_CONFIG`` (same meaning, per
    NCC_EARG001's doc), else the compiler's default for the target (2 on trn2/trn3, 1 elsewhere: _release)."""
    words = shlex.split(flags)
    found: str | None = None
    for index, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in ("--lnc", "-lnc", "--logical-nc-config"):
            found = value if eq else (words[index + 1] if index + 1 < len(words) else None)
    if found is None:
        found = os.environ.get("NEURON_LOGICAL_NC_CONFIG") or None
    return int(found) if found else default_lnc(target)


def _target(flags: str) -> str:
    """The compile's platform: --target in the flags, else the one frozen at import (NXD model_builder.py:L608)."""
    words = shlex.split(flags)
    for index, word in enumerate(words):
        if word == "--target" and index + 1 < len(words):
            return words[index + 1]
    if PLATFORM_AT_IMPORT is None:
        raise RuntimeError("If you want to compile on CPU, please supply compiler argument target, with one of "
                           "options trn1, inf2, trn1n, or trn2. Ex: \"--target trn1\"")
    return PLATFORM_AT_IMPORT


def _without_logfile(flags: str) -> str:
    return " ".join(word for word in flags.split() if not word.startswith("--logfile="))


class NeuronApplicationBase(torch.nn.Module):
    _STATE_DICT_MODEL_PREFIX = "model."
    _NEW_STATE_DICT_MODEL_PREFIX = ""

    def __init__(self, model_path: str, config: InferenceConfig | None = None,
                 neuron_config: NeuronConfig | None = None) -> None:
        super().__init__()
        model_path = normalize_path(model_path)
        if config is None:
            raise NotImplementedError("TEST DOUBLE: loading a compiled model's config is not emulated")
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_path = model_path
        self.is_compiled = is_compiled(model_path)
        self._builder: _Builder | None = None

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        if not hasattr(config, "neuron_config"):
            raise ValueError("Config must include a NeuronConfig")

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        raise NotImplementedError("get_config_cls is not implemented")

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        """NXDI@ef2731e application_base.py:L224-L226 (v0.1.0 L131): the model's config class says."""
        return cls.get_config_cls().get_neuron_config_cls()

    def build_modules(self) -> None:
        """What the model's modules read from its config when NxDI builds them for tracing (the real classes build
        them inside the model wrappers' trace; the double does it first thing in compile). Models override it."""

    def get_compiler_args(self) -> str | None:
        return None  # L236-L238: the model wrapper's default flags

    def submodels(self) -> list[tuple[str, list[int], str]]:
        raise NotImplementedError

    def graph_description(self, tag: str, bucket: int) -> str:
        """What a bucket's HLO is built from (model_wrapper.py:L1455-L1485: the config, never the checkpoint)."""
        config = to_dict(self.config)
        for name in ("_name_or_path", "transformers_version"):
            config.pop(name, None)
        config["neuron_config"].pop("buckets", None)
        return json.dumps({"model": type(self).__name__, "config": config, "tag": tag, "bucket": bucket,
                           "nxdi": current().nxdi, "nxd": current().neuronx_distributed}, sort_keys=True, default=str)

    def get_builder(self, debug: bool = False) -> _Builder:
        if self._builder is None:
            self._builder = _Builder(self, os.environ.get("BASE_COMPILE_WORK_DIR", "/tmp/nxd_model/"))
        return self._builder

    def compile(self, compiled_model_path: str, debug: bool = False, pre_shard_weights_hook: Any = None,
                dry_run: bool = False) -> None:
        if dry_run and nxdi_minor() < "0.3":
            raise TypeError("compile() got an unexpected keyword argument 'dry_run'")
        compiled_model_path = normalize_path(compiled_model_path)
        self.build_modules()
        self.config.save(compiled_model_path)
        logger.info(f"Saving the neuron_config to {compiled_model_path}")
        traced_model = self.get_builder(debug).trace(initialize_model_weights=False, dry_run=dry_run)
        self.config.save(self.get_builder().compiler_workdir)  # L267-L270 (2.24+)
        if dry_run:
            return
        started = time.monotonic()
        torch.jit.save(traced_model, compiled_model_path + COMPILED_MODEL_FILE_NAME)
        logger.info(f"Saved {COMPILED_MODEL_FILE_NAME} in {time.monotonic() - started:.2f}s")
        del traced_model
        self.shard_weights(compiled_model_path, debug, pre_shard_weights_hook)
        self.is_compiled = True

    def shard_weights(self, compiled_model_path: str, debug: bool = False, pre_shard_weights_hook: Any = None) -> None:
        sharded_checkpoint_dir = os.path.join(normalize_path(compiled_model_path), "weights/")
        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        if self.neuron_config.skip_sharding:
            logger.info("Pre-sharding the checkpoints is forced to be SKIPPED with skip_sharding.")
        elif not self.neuron_config.save_sharded_checkpoint:
            logger.info("SKIPPING pre-sharding the checkpoints. The checkpoints will be sharded during load time.")
        else:
            logger.info("Pre-sharding checkpoints.")
            self.get_builder(debug).shard_checkpoint(serialize_path=sharded_checkpoint_dir)

    def checkpoint_loader_fn(self, mmap: bool = False) -> dict[str, torch.Tensor]:
        model_path = getattr(self.config, "_name_or_path", None)
        if model_path is None or not os.path.exists(model_path):
            model_path = self.model_path
        if self.neuron_config.quantized:
            existing = self.neuron_config.quantized_checkpoints_path
            if not os.path.exists(existing):
                raise FileNotFoundError(f"Quantized checkpoint file not found: {existing}")
            model_path = existing
        model_sd = self.get_state_dict(model_path, self.config)
        if self.neuron_config.torch_dtype != torch.float32 and getattr(self.neuron_config, "cast_type",
                                                                        "config") == "config":
            for name, param in model_sd.items():  # L677-L681: floating weights to the config's dtype
                if torch.is_floating_point(param) and param.dtype != self.neuron_config.torch_dtype:
                    model_sd[name] = param.to(self.neuron_config.torch_dtype)
        return model_sd

    @classmethod
    def get_state_dict(cls, model_name_or_path: str, config: InferenceConfig) -> dict[str, torch.Tensor]:
        """L693-L739: a directory's HF weights, the model prefix renamed (``model.`` -> ``""``)."""
        from neuronx_distributed_inference.modules.checkpoint import load_state_dict

        if not os.path.isdir(model_name_or_path):
            raise NotImplementedError("TEST DOUBLE: only a checkpoint directory is emulated")
        model_sd = load_state_dict(model_name_or_path)
        return {(cls._NEW_STATE_DICT_MODEL_PREFIX + k[len(cls._STATE_DICT_MODEL_PREFIX):]
                 if k.startswith(cls._STATE_DICT_MODEL_PREFIX) else k): v for k, v in model_sd.items()}
