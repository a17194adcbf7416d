"""Loading a model file for compiling, and the deterministic example inputs of a shape bucket.

Owns: reading the three torch model formats (torchscript, exported-program, hf-dir), safe extraction of
hf-dir archives, the order in which bucket inputs are passed to ``forward``, and example tensors.

Error policy (see :mod:`workers.compiling.contract`): a model file that exists but cannot be read or run is a
property of the model's bytes (which are in the key; the runner checks their digest before launching the
child), so it is a :class:`CompileFailure`. A missing file, host memory exhaustion or a package missing
on this worker is an :class:`InfraError`.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compilesvc.states import ErrorClass
from workers.compiling.archive_limits import DEFAULT_EXTRACT_LIMITS, safe_extract
from workers.compiling.classify import judge
from workers.compiling.contract import CompileFailure, ExtractLimits, InfraError, InputDesc, log
from workers.compiling.failure_table import Evidence

#: Example token ids are drawn from [0, ID_HIGH): inside any real vocabulary and the demo model's.
ID_HIGH = 100
EXAMPLE_SEED = 0

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

def raise_if_host_trouble(exc: BaseException) -> None:
    """Re-raise ``exc`` as an :class:`InfraError` when it is the host's fault rather than the model's.

    The classification table decides (:func:`workers.compiling.classify.judge`, one table for every backend): torch
    reports CPU allocation failures as a plain RuntimeError ("DefaultCPUAllocator: can't allocate
    memory"), and treating those as the model's errors would fail a key for good because one host was busy.
    Anything the table does not call the host's is left to the caller.
    """
    verdict = judge(Evidence([f"{type(exc).__name__}: {exc}"], status=None,
                             exception=tuple(cls.__name__ for cls in type(exc).__mro__), who="the model"))
    if verdict.error_class == ErrorClass.INFRA:
        raise InfraError(verdict.code, verdict.message) from exc


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def example_inputs(inputs: Sequence[InputDesc]) -> list[torch.Tensor]:
    """Deterministic example tensors for a bucket, in the order given.

    - integer inputs whose name ends in ``ids`` (input_ids, token_type_ids, position_ids): uniform in
      [0, 100) — valid indices for any embedding the model has;
    - names ending in ``mask``: all ones (nothing masked, so no all-masked rows produce NaNs);
    - other integers and bools: zeros;
    - floats: standard normal, drawn in float32 then cast, so the values do not depend on the dtype.

    Each input has its own generator seeded from its name, so values do not depend on input order.
    """
    tensors = []
    for desc in inputs:
        dtype = torch_dtype(desc.dtype)
        shape = tuple(desc.shape)
        generator = torch.Generator().manual_seed(EXAMPLE_SEED + zlib.crc32(desc.name.encode()))
        lowered = desc.name.lower()
        if dtype == torch.bool:
            tensor = torch.zeros(shape, dtype=dtype)
        elif dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        elif lowered.endswith("mask"):
            tensor = torch.ones(shape, dtype=dtype)
        elif lowered.endswith("ids"):
            tensor = torch.randint(0, ID_HIGH, shape, generator=generator, dtype=dtype)
        else:
            tensor = torch.zeros(shape, dtype=dtype)
        tensors.append(tensor)
    return tensors


def forward_parameter_names(model: nn.Module) -> list[str] | None:
    """The names of ``model.forward``'s parameters (without self), or None if they cannot be read."""
    forward = model.forward
    schema = getattr(forward, "schema", None)  # ScriptModule methods expose a schema, not a signature
    if schema is not None:
        return [arg.name for arg in schema.arguments if arg.name != "self"]
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def order_inputs(model: nn.Module, inputs: Sequence[InputDesc]) -> list[InputDesc]:
    """The bucket's inputs in ``forward``'s parameter order.

    Tracing and exporting pass inputs positionally, while the spec names them; if every name is a
    parameter of ``forward`` we follow the signature, otherwise the spec's order (and the trace will fail
    with the model's own error if that is wrong).
    """
    params = forward_parameter_names(model)
    if params is None or not all(desc.name in params for desc in inputs):
        return list(inputs)
    return sorted(inputs, key=lambda desc: params.index(desc.name))


def run_forward(model: nn.Module, tensors: Sequence[torch.Tensor], code: str) -> Any:
    """Run the model once at the bucket's inputs; failure is the model's (``code``), unless the host's.

    Backends call this before tracing so "this model cannot run at these shapes" is told apart from
    "the tracer/compiler failed" in one place, for every format.
    """
    try:
        with torch.no_grad():
            return model(*tensors)
    except Exception as exc:
        raise_if_host_trouble(exc)
        raise CompileFailure(code, f"the model's forward fails at these input shapes: {type(exc).__name__}: "
                                   f"{exc}") from exc


def _to_tensors(value: Any) -> Any:
    """Model outputs as a tensor or a (nested) tuple of tensors: what torch.jit.trace can return."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):  # transformers ModelOutput is an OrderedDict; transformers 5 returns dicts
        items = [_to_tensors(v) for v in value.values()]
    elif isinstance(value, list | tuple):
        items = [_to_tensors(v) for v in value]
    else:
        return None  # caches and other objects are not outputs of an inference graph
    kept = tuple(item for item in items if item is not None)
    return kept if kept else None


class TensorOutputs(nn.Module):
    """Wraps a model taking keyword inputs so it takes them positionally and returns only tensors.

    Hugging Face models take many optional keyword arguments in an order that is not the spec's, and
    return dicts (always, in transformers 5); tracing needs positional tensors in and tensors out.
    """

    def __init__(self, model: nn.Module, input_names: Sequence[str]):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)

    def forward(self, *args: torch.Tensor) -> Any:
        return _to_tensors(self.model(**dict(zip(self.input_names, args, strict=True))))


#: The weight files ``from_pretrained`` reads from a local directory, in its order of preference:
#: transformers' SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME
#: (transformers/utils/__init__.py; modeling_utils.py's _get_resolved_checkpoint_files tries them in turn).
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def check_hf_weights(root: Path) -> None:
    """An hf-dir without weights is the user's mistake, the same on every worker: a compile error now, not
    transformers' "no file named model.safetensors" OSError, which reads as the host's file trouble."""
    if not any((root / name).is_file() for name in HF_WEIGHT_FILES):
        raise CompileFailure("HF_DIR_NO_WEIGHTS", "hf-dir archive has config.json but no weights beside it: "
                                                  f"add one of {', '.join(HF_WEIGHT_FILES)}")


def _load_hf_dir(path: Path, work_dir: Path, input_names: Sequence[str], limits: ExtractLimits) -> nn.Module:
    # Extract first: an unusable archive is the model's fault on every worker, a missing transformers is not.
    root = safe_extract(path, work_dir / "hf-model", limits)
    check_hf_weights(root)
    try:
        import transformers  # optional: only hf-dir models need it
    except ImportError as exc:
        raise InfraError("TRANSFORMERS_MISSING", "transformers is not installed on this worker; hf-dir models "
                                                 "need it (pip install transformers)") from exc
    log(f"loading hf-dir model from {root} with transformers {transformers.__version__}")
    try:
        model = transformers.AutoModel.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        # transformers reports what a local model directory lacks (a shard its index names, say) as a bare
        # OSError without an errno: the model's fault. The host's own I/O failures carry one.
        if not (isinstance(exc, OSError) and exc.errno is None):
            raise_if_host_trouble(exc)
        raise CompileFailure("MODEL_LOAD_ERROR", f"transformers cannot load the hf-dir model: {exc}") from exc
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # key/value caches are not tensors and not part of one inference graph
    return TensorOutputs(model, input_names)


def load_model(path: Path, model_format: str, work_dir: Path, input_names: Sequence[str],
               limits: ExtractLimits = DEFAULT_EXTRACT_LIMITS) -> nn.Module:
    """The model at ``path`` as an eval-mode module on the CPU.

    ``input_names`` (the bucket's) is used by hf-dir models, which are wrapped to take them positionally.
    """
    if not path.is_file():
        raise InfraError("MODEL_FILE_MISSING", f"model file {path} does not exist on this worker")
    try:
        if model_format == "torchscript":
            model: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        elif model_format == "exported-program":
            model = torch.export.load(str(path)).module()
        elif model_format == "hf-dir":
            model = _load_hf_dir(path, work_dir, input_names, limits)
        else:
            raise CompileFailure("MODEL_FORMAT", f"model format {model_format!r} cannot be loaded into torch")
    except (CompileFailure, InfraError):
        raise
    except OSError as exc:
        raise InfraError("MODEL_FILE_UNREADABLE", f"cannot read model file {path}: {exc}") from exc
    except Exception as exc:
        raise_if_host_trouble(exc)
        raise CompileFailure("MODEL_LOAD_ERROR", f"cannot load the {model_format} model: "
                                                 f"{type(exc).__name__}: {exc}") from exc
    # ExportedProgram.module() raises NotImplementedError on .eval(); its graph was captured in the mode it
    # was exported in, so there is nothing to switch.
    if model_format != "exported-program":
        model.eval()
    return model
