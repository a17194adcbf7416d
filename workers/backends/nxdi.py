"""The ``nxdi`` backend: an NxD Inference (NxDI) compile of a Hugging Face checkpoint directory.

Owns how a compile request becomes ``Model(checkpoint_dir, config).compile(out_dir)`` and how its failures and
its output directory are reported. In the compile child, in this order (docs/research/nxdi.md):

1. the release and the installed packages are the key's (:func:`workers.host.versions.nxdi_unavailable`, and
   the trace checks of :mod:`workers.backends.neuron`);
2. the environment, before any Neuron import: ``NEURON_PLATFORM_TARGET_OVERRIDE`` = the request's target (§6:
   models overriding ``get_compiler_args`` never get ``--target``/``--lnc``, e.g. Qwen2 and Mixtral, so the
   platform is what the libraries see at import; 2.29's NeuronConfig would otherwise write its own guess),
   ``BASE_COMPILE_WORK_DIR`` inside the attempt's work dir (§2: ModelBuilder wipes it at each trace; the
   default ``/tmp/nxd_model/`` is shared by every compile on the host), a per-compile Neuron cache
   (:mod:`workers.backends.neuron_cache`), and no ``NXD_LAYOUT_TRANSFORMATION_OPTIONS`` (§1: it changes the
   pre-sharded weights and is in no key);
3. NxDI's own ``load_pretrained_config`` (transformers' AutoConfig of config.json), ``NeuronConfig(**neuron_config)``
   and the model's InferenceConfig class; then ``compile(out_dir)``, which writes ``neuron_config.json``,
   ``model.pt`` and, with ``save_sharded_checkpoint``, ``weights/tp{rank}_sharded_checkpoint.safetensors``;
4. every file under the output directory is reported: ``model.pt`` role ``model``, ``weights/…`` role
   ``weights-shard`` (with its rank), anything else ``aux``; the child streams each one's sha256.

Failures: NxDI's checks of the config (``ValueError``/``AssertionError``/``NotImplementedError`` with NxDI's texts,
config.py; ``Config must define [...]`` for a config.json lacking what the model needs) are final compile errors
naming the field (``NXDI_CONFIG_ERROR``); missing weights when pre-sharding (modules/checkpoint.py's
FileNotFoundError) are final, naming the file (``NXDI_WEIGHTS_MISSING``); the compiler's own failures go through
:data:`workers.compiling.failure_table.TABLE` (F137 and a SIGKILL are the host's memory: infrastructure).

The NxDI model class: the request's ``nxdi_model`` ("package.module:Class"), which the runner takes from the
spec's architecture hub (:func:`compilesvc.spec.nxdi_models.class_path`), the table that admitted the spec; a
request without one looks config.json's architecture up in that same table.
Nothing here imports torch, transformers or the SDK at module level.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from compilesvc.spec import neuron_kinds, neuron_releases, neuron_toolchain, nxdi_models
from workers.backends.neuron import check_neuron_cc_flags, freeze_platform_target
from workers.backends.neuron_cache import own_compile_cache
from workers.backends.output_tee import OutputTee
from workers.compiling.classify import judge
from workers.compiling.contract import (
    ArtifactFile,
    Backend,
    CompileFailure,
    CompileRequest,
    CompileResult,
    InfraError,
    failure_for,
    log,
)
from workers.compiling.failure_table import Evidence
from workers.host.versions import (
    NEURON_SDK_ENV,
    installed_neuron_packages,
    module_version,
    neuron_manifest_versions,
    neuronx_distributed_inference_version,
    neuronxcc_package_version,
    nxdi_release_version,
    nxdi_unavailable,
    python_version,
    torch_neuronx_version,
)
from workers.isolation.child_env import PLATFORM_OVERRIDE_ENV

WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"
#: Never given to a compile (docs/research/nxdi.md §1, §3): they change the artifact and are in no key.
UNKEYED_ENV = ("NXD_LAYOUT_TRANSFORMATION_OPTIONS", "NEURON_LOGICAL_NC_CONFIG")
#: NxDI's config messages (NXDI@ef2731e models/config.py, model_base.py; docs/research/nxdi.md §3, §8) -> the
#: neuron_config field they are about, where the text does not name it.
_MESSAGE_FIELDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^Unsupported dtype"), "torch_dtype"),
    # NXDI@ef2731e models/mixtral/modeling_mixtral.py:L56, asserted while building the model's weights/modules.
    (re.compile(r"^Only GLU MLP is supported"), "glu_mlp"),
    (re.compile(r"^Context bucket"), "context_encoding_buckets"),
    (re.compile(r"^Token generation bucket"), "token_generation_buckets"),
    (re.compile(r"^Token generation batch buckets|^Batch bucketing"), "token_generation_batches"),
    (re.compile(r"^max_context_length cannot"), "max_context_length"),
    (re.compile(r"^TP Degree must be evenly divisible by CP"), "cp_degree"),
    (re.compile(r"^TP Degree must be evenly divisible by DP|DP Degree"), "attention_dp_degree"),
    (re.compile(r"Chunked Prefill|chunked prefill"), "chunked_prefill_config"),
    (re.compile(r"Context Parallel for MLP"), "mlp_cp_degree"),
    (re.compile(r"^quantized_checkpoints_path is required"), "quantized_checkpoints_path"),
)


def _field_of(message: str, given: dict[str, Any]) -> str:
    for pattern, name in _MESSAGE_FIELDS:
        if pattern.search(message):
            return name
    named = [name for name in given if re.search(rf"\b{re.escape(name)}\b", message)]
    return named[0] if named else "neuron_config"


def _config_failure(exc: BaseException, given: dict[str, Any]) -> NoReturn:
    text = str(exc) or type(exc).__name__
    field = _field_of(text, given)
    where = "neuron_config" if field == "neuron_config" else f"neuron_config.{field}"
    raise CompileFailure("NXDI_CONFIG_ERROR", f"{where}: NxD Inference refused the configuration: "
                                              f"{type(exc).__name__}: {text}") from exc


_LNC_FLAG = re.compile(r"(?:^|\s)(?:--lnc|-lnc|--logical-nc-config)(?:[=\s]|$)")


def with_lnc_flag(cls: Any, lnc: int) -> Any:
    """``cls``, or a subclass whose compiler flags name ``--lnc=<lnc>`` where the model's own omit it.

    NxDI's default flags pass ``--lnc`` (models/model_wrapper.py; the double's ``_default_flags``), but models
    that override ``get_compiler_args`` with a fixed string (Qwen2: NXDI@ef2731e models/qwen2/modeling_qwen2.py
    L237-L242; Mixtral: models/mixtral/modeling_mixtral.py:L321-L330) pass none, and the compile child removes
    ``NEURON_LOGICAL_NC_CONFIG`` (workers/isolation/child_env.py): neuronx-cc then compiles at its default, LNC 2
    on trn2/trn3, while NxD lays the graph out for ``logical_nc_config``. The key's LNC must be what reaches the
    compiler, so the flag is added. A subclass, not a patched instance: NxDI reads the flags while building its
    model wrappers in ``__init__`` (application_base.py / model_base.py ``enable_context_encoding``)."""
    own = cls.get_compiler_args

    def get_compiler_args(self: Any) -> Any:
        flags = own(self)
        if flags is None or _LNC_FLAG.search(flags):
            return flags  # None: the wrapper's default flags, which carry --lnc
        return f"{flags} --lnc={lnc}"

    return type(cls.__name__, (cls,), {"get_compiler_args": get_compiler_args, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _service_bug(cls: Any, what: str, exc: BaseException) -> NoReturn:
    """NxDI could not build ``what`` from a configuration the service validated: the service's bug (it admitted
    or built something NxDI cannot take), never the model's and never worth a retry. Final, with a code that
    says so and a log line alerting can match (``SERVICE BUG``)."""
    message = (f"SERVICE BUG: NxD Inference could not build {what} of {cls.__name__} from the validated "
               f"neuron_config: {type(exc).__name__}: {exc}")
    log(message)
    raise CompileFailure("NXDI_SERVICE_BUG", message) from exc


def nxdi_kwargs(neuron_config: dict[str, Any]) -> dict[str, Any]:
    """The NeuronConfig keywords of the request's canonical ``neuron_config`` (the key's: bucket short form already
    expanded, :mod:`compilesvc.spec.nxdi_buckets`), as a deep copy: NxDI sorts bucket lists in place."""
    kwargs: dict[str, Any] = json.loads(json.dumps(neuron_config))
    # quantize_clamp_bound's default is float("inf") (NXDI@ef2731e models/config.py:L551), which JSON cannot hold:
    # the canonical form writes null for it. Passing None would defeat Llama's fallback to 1200 for the quantized
    # MLP kernel, which tests ``== float("inf")`` (models/llama/modeling_llama.py:L339-L345): leave it to NxDI.
    if "quantize_clamp_bound" in kwargs and kwargs["quantize_clamp_bound"] is None:
        del kwargs["quantize_clamp_bound"]
    return kwargs


def model_class(request: CompileRequest, checkpoint: Path) -> Any:
    """The NxDI class to compile with (see the module docstring)."""
    spec = request.nxdi_model
    if spec is None:  # the runner names it; else the same hub table, from config.json's architectures
        try:
            config = json.loads((checkpoint / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CompileFailure("NXDI_CHECKPOINT_CONFIG", f"model config.json: cannot be read: {exc}") from exc
        try:
            spec = nxdi_models.class_path(request.sdk, config if isinstance(config, dict) else {})
        except nxdi_models.UnsupportedArchitecture as exc:
            raise CompileFailure("NXDI_UNSUPPORTED_ARCHITECTURE", f"model config.json architectures: {exc}") from exc
    module_name, _, class_name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("neuronx_distributed_inference.models."):
            raise CompileFailure("NXDI_UNSUPPORTED_ARCHITECTURE", f"{spec}: this NxD Inference release has no "
                                                                  f"such model ({exc})") from exc
        raise InfraError("NXDI_MISSING", f"NxD Inference is not importable on this worker: {exc}") from exc
    except AttributeError as exc:
        raise CompileFailure("NXDI_UNSUPPORTED_ARCHITECTURE", f"{spec}: no such class in this NxD Inference "
                                                              "release") from exc


def output_files(out_dir: Path) -> list[ArtifactFile]:
    """Every file NxDI wrote under ``out_dir``, with its role (issue 29's contract), in path order."""
    files = []
    for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(out_dir).as_posix()
        match = re.fullmatch(r"weights/tp(\d+)_sharded_checkpoint\.safetensors", relative)
        if relative == "model.pt":
            files.append(ArtifactFile(relative, "model"))
        elif match:
            files.append(ArtifactFile(relative, "weights-shard", {"rank": int(match.group(1))}))
        else:
            files.append(ArtifactFile(relative, "aux"))
    return files


def _same_toolchain(requested: str, host: str, tp_degree: int) -> list[str]:
    """How ``host``'s NxDI toolchain differs from ``requested``'s (empty: none). The release table's own answer when
    it knows NxDI compiles; else the packages an NxDI compile runs, compared here."""
    try:
        return neuron_toolchain.toolchain_differences(requested, host, "nxdi", tp_degree)
    except neuron_kinds.NotShipped as exc:
        return [str(exc)]
    except ValueError:  # a table without an NxDI kind: compare what it lists, and NxDI's own version
        pass
    try:
        want, have = neuron_releases.lookup(requested), neuron_releases.lookup(host)
    except neuron_releases.UnknownRelease as exc:
        return [str(exc)]
    pairs = {"neuronx-cc": (want.neuronx_cc, have.neuronx_cc),
             "torch-neuronx": (want.trace_torch_neuronx, have.trace_torch_neuronx),
             "neuronx-distributed": (want.neuronx_distributed, have.neuronx_distributed),
             "neuronx-distributed-inference": (nxdi_release_version(requested), nxdi_release_version(host))}
    return [f"{package}: release {requested} has {a}, this host's {host} has {b}"
            for package, (a, b) in pairs.items() if a != b]


def _check_host(request: CompileRequest) -> str | None:
    """The host's release and packages are the ones the key names (the trace backend's checks, for NxDI)."""
    host = os.environ.get(NEURON_SDK_ENV, "").strip() or None
    if host is None:
        log(f"{NEURON_SDK_ENV} is not set: cannot check that this host has Neuron SDK {request.sdk}")
    elif host != request.sdk:
        differences = _same_toolchain(request.sdk, host, request.tp_degree)
        if differences:
            raise InfraError("WRONG_SDK", f"this host has Neuron SDK {host}, the request needs {request.sdk}: "
                             + "; ".join(differences))
        log(f"request for Neuron SDK {request.sdk} runs on {host}: the same NxD Inference toolchain")
    why = nxdi_unavailable(request.sdk)
    if why is not None:
        raise InfraError("NXDI_MISSING" if "not installed" in why else "TOOLCHAIN_MISMATCH",
                         f"cannot compile with NxD Inference for Neuron SDK {request.sdk}: {why}")
    # An SDK upgraded under a running worker would publish under the old toolchain's key.
    packages = {**installed_neuron_packages(neuronx_cc=neuronxcc_package_version()),
                "neuronx-cc": neuronxcc_package_version()}
    try:
        mismatches = neuron_releases.installed_mismatches(request.sdk, packages)
    except neuron_releases.UnknownRelease as exc:
        raise InfraError("WRONG_SDK", str(exc)) from None
    if mismatches:
        raise InfraError("TOOLCHAIN_MISMATCH", f"this worker's packages are not Neuron SDK {request.sdk}'s "
                         "(upgraded since the worker started? restart it): " + "; ".join(mismatches))
    return host


def _prepare_environment(request: CompileRequest) -> Path:
    # NxDI and NxD log through the "Neuron" logger at INFO ("generating HLO: …", "Neuron compiler flags: …",
    # "SKIPPING pre-sharding …"): the compile's log must show them, in the form users post them (basicConfig's
    # "INFO:Neuron:…", aws-neuron-sdk#1222).
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    # The checkpoint is a local directory: a compile never downloads (and a sandboxed one has no network), so
    # Hugging Face's libraries must not try (set before transformers is imported).
    os.environ["HF_HUB_OFFLINE"] = "1"
    freeze_platform_target(request.target)
    for name in UNKEYED_ENV:
        if os.environ.pop(name, None) is not None:
            log(f"{name} removed from this compile's environment: it changes the artifact and is in no key")
    work = request.work_dir / "nxd_model"
    work.mkdir(parents=True, exist_ok=True)
    os.environ[WORK_DIR_ENV] = str(work)
    own_compile_cache(request.work_dir)
    log(f"{PLATFORM_OVERRIDE_ENV}={os.environ[PLATFORM_OVERRIDE_ENV]} {WORK_DIR_ENV}={work}")
    return work


class NxdiBackend(Backend):
    """NxD Inference: ``Model(checkpoint, config).compile(out_dir)``."""

    name = "nxdi"

    def compile(self, request: CompileRequest) -> CompileResult:
        host_sdk = _check_host(request)
        check_neuron_cc_flags(for_trace=True)
        _prepare_environment(request)
        checkpoint = request.model_path
        given = dict(request.neuron_config or {})
        cls = model_class(request, checkpoint)  # the first Neuron import: after the environment is set
        try:
            from neuronx_distributed_inference.models.config import NeuronConfig
            from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config
        except ImportError as exc:
            raise InfraError("NXDI_MISSING", f"NxD Inference is not importable on this worker: {exc}") from exc

        # The model's own NeuronConfig class, as NxDI's demo and vLLM's loaders build it (NXDI@ef2731e
        # inference_demo.py:L489 ``model_cls.get_neuron_config_cls()(**config_kwargs)``; application_base.py
        # L224-L226, in every release since v0.1.0 L131): MoENeuronConfig for Mixtral / Qwen3-MoE / Llama4 text,
        # own classes for DBRX, GPT-OSS, Qwen2/3, Gemma3. The base NeuronConfig lacks the fields their modules read
        # (capacity_factor, glu_mlp, router_config, blockwise_matmul_config): an AttributeError while building.
        try:
            neuron_config_cls = cls.get_neuron_config_cls()
        except NotImplementedError as exc:  # ImageToTextInferenceConfig's (image_to_text_model_base.py:L114-L115)
            raise CompileFailure("NXDI_UNSUPPORTED_ARCHITECTURE", f"{cls.__name__}: NxD Inference builds it from "
                                                                  f"two NeuronConfigs: not supported") from exc
        if not issubclass(neuron_config_cls, NeuronConfig):  # pragma: no cover - NxDI's classes all are
            raise InfraError("NXDI_MISSING", f"{cls.__name__}.get_neuron_config_cls() is not a NeuronConfig")
        try:
            neuron_config = neuron_config_cls(**nxdi_kwargs(given))
        except (ValueError, AssertionError, TypeError, NotImplementedError) as exc:
            _config_failure(exc, given)
        try:
            config = cls.get_config_cls()(neuron_config, load_config=load_pretrained_config(str(checkpoint)))
        except AssertionError as exc:  # "Config must define [...]": the checkpoint's config.json lacks it
            raise CompileFailure("NXDI_CONFIG_ERROR", f"model config.json: {cls.__name__} needs what it lacks: "
                                                      f"{exc}") from exc
        except (OSError, ValueError, KeyError) as exc:  # transformers could not read or does not know config.json
            raise CompileFailure("NXDI_CHECKPOINT_CONFIG", f"model config.json: {type(exc).__name__}: {exc}") from exc
        except (AttributeError, TypeError) as exc:
            _service_bug(cls, "its InferenceConfig", exc)
        lnc = int(getattr(neuron_config, "logical_nc_config", None)  # 2.21: logical_neuron_cores only
                  or getattr(neuron_config, "logical_neuron_cores", None) or 1)
        cls = with_lnc_flag(cls, lnc)
        try:
            model = cls(str(checkpoint), config)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            _config_failure(exc, given)
        except (AttributeError, TypeError) as exc:
            _service_bug(cls, "the model", exc)
        log(f"NxD Inference {neuronx_distributed_inference_version()}: {cls.__name__}.compile({request.out_dir}) "
            f"tp_degree={neuron_config.tp_degree} save_sharded_checkpoint={neuron_config.save_sharded_checkpoint}")

        started = time.monotonic()
        tee = OutputTee()
        try:
            with tee:
                model.compile(str(request.out_dir))
        except FileNotFoundError as exc:  # pre-sharding reads the weights: the checkpoint lacks them
            raise CompileFailure("NXDI_WEIGHTS_MISSING", f"model weights: {exc} (neuron_config.save_sharded_checkpoint"
                                                         " reads them at compile time)") from exc
        except (AttributeError, TypeError) as exc:  # building the modules from the config, before any compiler
            _service_bug(cls, "its modules", exc)
        except AssertionError as exc:
            if _field_of(str(exc), given) in given:  # a module's own check of a field (Mixtral: glu_mlp, L56)
                _config_failure(exc, given)
            _raise_for_compile_failure(exc, [*tee.lines, *str(exc).splitlines()])
        except Exception as exc:
            _raise_for_compile_failure(exc, [*tee.lines, *str(exc).splitlines()])
        log(f"NxD Inference compiled in {time.monotonic() - started:.2f} s")
        files = output_files(request.out_dir)
        if not any(f.role == "model" for f in files):
            raise InfraError("NO_OUTPUT", "NxD Inference's compile returned but wrote no model.pt")
        packages = installed_neuron_packages()
        versions = {
            "neuronx_distributed_inference": neuronx_distributed_inference_version() or "unknown",
            "neuronx_distributed": packages.get("neuronx-distributed") or "unknown",
            "torch_neuronx": torch_neuronx_version() or "unknown",
            "neuronx_cc": module_version("neuronxcc") or packages.get("neuronx-cc") or "unknown",
            "python": python_version(),
            "target": request.target,
            **neuron_manifest_versions(host_sdk, trace=True),
        }
        return CompileResult(files=files, versions=versions)


def _raise_for_compile_failure(exc: BaseException, lines: list[str]) -> NoReturn:
    """NxDI's compile failed in the compiler or the host: the classification table decides (F137 and memory
    errors are the host's; a compiler code is the model's)."""
    match = re.search(r"failed with (-?\d+)", str(exc))
    status = int(match.group(1)) if match else None
    names = tuple(cls.__name__ for cls in type(exc).__mro__)
    verdict = judge(Evidence([*lines, f"{type(exc).__name__}: {exc}"], status, exception=names,
                             who="NxD Inference's compile" if status is None else "neuronx-cc (under NxD Inference)",
                             unknown_code="NXDI_COMPILE_FAILED" if status is None else f"NEURONX_CC_EXIT_{status}"))
    raise failure_for(verdict.error_class, verdict.code, verdict.message) from exc
