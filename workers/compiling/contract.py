"""The compiler-backend contract: the request a backend gets, what it returns, how it fails.

This module owns the shapes exchanged between :mod:`workers.backends.compile_child` and the backends. It imports
neither torch nor any Neuron package, so the child can parse and validate a request (and the runner can
import the exit codes) on any host.

How a backend reports trouble decides what the runner does next (a :class:`BackendFailure` subclass;
the Neuron backends choose it with :func:`workers.compiling.classify.judge`, see :func:`failure_for`):

- :class:`CompileFailure` (child exit 3): deterministic for this key — the compiler's own error code, an
  unsupported operator, a model that cannot be traced or exported at the bucket's shapes. Final.
- :class:`FlagRejected` (exit 5): the compiler refused a flag of the request. Final.
- :class:`InfraError` (exit 4): a problem of this worker or host — the wrong ISA, a missing package, the
  compiler killed by a signal. Retried, possibly elsewhere.
- :class:`UnexplainedFailure` (exit 6): the compiler failed and left no evidence of why. Retried a bounded
  number of times.
- anything else escapes as an exception (child exit 1, traceback on stderr), classified by the runner
  from the log (usually unknown).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError

from compilesvc.compiles.failures import MAX_MESSAGE, shorten
from compilesvc.spec.buckets import InputSpec
from compilesvc.spec.compile_spec import BACKEND_FORMATS, NEURON_TARGETS
from compilesvc.states import ErrorClass

#: Child exit codes (see :mod:`workers.backends.compile_child`).
EXIT_OK = 0
EXIT_UNCAUGHT = 1
EXIT_BAD_REQUEST = 2
EXIT_COMPILE_ERROR = 3
EXIT_INFRA_ERROR = 4
EXIT_FLAG_REJECTED = 5
EXIT_UNEXPLAINED = 6

#: Longest message kept in result.json: the ledger's bound (the full text is in the streamed log).
MAX_MESSAGE_CHARS = MAX_MESSAGE

LOG_PREFIX = "[compile-child]"


def log(message: str) -> None:
    """One progress line on stdout, flushed at once: the runner streams the child's stdout line by line."""
    print(f"{LOG_PREFIX} {message}", flush=True)


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` squeezed to one line of at most ``limit`` characters (for result.json messages); a longer one
    keeps its head and its tail (:func:`compilesvc.compiles.failures.shorten`: the compiler's error is at the end)."""
    return shorten(" ".join(str(text).split()), limit)


class BackendFailure(Exception):
    """A failed compile with its class: ``status`` goes into result.json, ``exit_code`` is the child's."""

    status: ClassVar[str]
    exit_code: ClassVar[int]
    error_class: ClassVar[ErrorClass]

    def __init__(self, code: str, message: str):
        self.code = code
        #: The whole text, for the streamed log when ``message`` (result.json's, the ledger's) had to be cut.
        self.full_text = str(message)
        self.message = one_line(message)
        super().__init__(f"{code}: {self.message}")


class CompileFailure(BackendFailure):
    """A deterministic compile error for this key: compiling again on any worker fails the same way.

    ``code`` is the compiler's own code when it has one (``NCC_EOOM001``) or one of ours
    (``CPU_TRACE_ERROR``, ``CPU_EXPORT_ERROR``, ``CPU_INDUCTOR_ERROR``, ``NEURON_TRACE_ERROR``,
    ``UNSUPPORTED_OPERATOR``, ``MODEL_LOAD_ERROR`` ...).
    """

    status, exit_code, error_class = "compile_error", EXIT_COMPILE_ERROR, ErrorClass.COMPILE


class FlagRejected(BackendFailure):
    """The compiler refused a flag of the request (the message names it): final, like a compile error."""

    status, exit_code, error_class = "bad_request", EXIT_FLAG_REJECTED, ErrorClass.BAD_REQUEST


class InfraError(BackendFailure):
    """A failure of this worker or host, not of the model: the compile should be retried (maybe elsewhere)."""

    status, exit_code, error_class = "infra_error", EXIT_INFRA_ERROR, ErrorClass.INFRA


class UnexplainedFailure(BackendFailure):
    """The compiler failed with no evidence of why: retried a bounded number of times, then reported."""

    status, exit_code, error_class = "unknown_error", EXIT_UNEXPLAINED, ErrorClass.UNKNOWN


_FAILURES: dict[ErrorClass, type[BackendFailure]] = {
    cls.error_class: cls for cls in (CompileFailure, FlagRejected, InfraError, UnexplainedFailure)}


def failure_for(error_class: ErrorClass, code: str, message: str) -> BackendFailure:
    """The exception reporting a failure of ``error_class`` (one of the four a backend can find)."""
    return _FAILURES[error_class](code, message)


class RequestError(ValueError):
    """The request JSON is malformed: a bug in the caller (the runner), reported as exit 2."""


@dataclass(frozen=True)
class InputDesc:
    """One model input of the bucket being compiled."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ExtractLimits:
    """Caps on what an hf-dir archive may expand to (:mod:`workers.compiling.archive_limits`): the worker's
    ``COMPILESVC_HF_EXTRACT_*`` settings; these defaults are the settings' own."""

    max_bytes: int = 256 * 1024**3
    max_files: int = 10_000
    max_ratio: float = 100.0

    @classmethod
    def from_json(cls, data: Any) -> ExtractLimits:
        if data is None:
            return cls()
        if not isinstance(data, Mapping) or set(data) != {"max_bytes", "max_files", "max_ratio"}:
            raise RequestError("extract_limits: expected {max_bytes, max_files, max_ratio} or null")
        for name in ("max_bytes", "max_files", "max_ratio"):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise RequestError(f"extract_limits.{name}: expected a positive number")
        return cls(int(data["max_bytes"]), int(data["max_files"]), float(data["max_ratio"]))


@dataclass(frozen=True)
class CompileRequest:
    """One compile of one shape bucket, as read from the request JSON (see :mod:`workers.backends.compile_child`)."""

    backend: str
    target: str
    sdk: str
    model_path: Path
    model_format: str
    inputs: tuple[InputDesc, ...]
    args: tuple[str, ...]
    tp_degree: int
    isa: str | None
    out_dir: Path
    work_dir: Path
    #: Most tensor-parallel ranks compiling at once (``Settings.neuron_max_parallel_rank_compiles``); None:
    #: the worker did not say, the backend derives it from this host's memory.
    max_parallel_rank_compiles: int | None = None
    #: Caps on extracting an hf-dir archive (the worker's settings; absent: the defaults).
    extract_limits: ExtractLimits = ExtractLimits()
    #: Neuron: the logical NeuronCore config resolved at submit (key material ``toolchain.lnc``); None in a
    #: request for a key made before schema 4, whose flags still carry any --logical-nc-config.
    lnc: int | None = None
    #: nxdi: the canonical NeuronConfig (key material ``neuron_config``, ``CompileSpec.nxdi_config``).
    neuron_config: dict[str, Any] | None = None
    #: nxdi: the NxDI model class, ``"package.module:Class"`` (the architecture hub's answer); None: the backend
    #: maps config.json's ``architectures[0]`` itself (:mod:`workers.backends.nxdi`).
    nxdi_model: str | None = None

    @property
    def family(self) -> str:
        return "cpu" if self.target == "cpu" else "neuron"

    @classmethod
    def from_json(cls, data: Any) -> CompileRequest:
        """Validate a decoded request document, raising :class:`RequestError` naming the bad field."""
        if not isinstance(data, Mapping):
            raise RequestError("the request must be a JSON object")
        required = ("backend", "target", "sdk", "model_path", "model_format", "inputs", "out_dir", "work_dir")
        missing = [name for name in required if name not in data]
        if missing:
            raise RequestError(f"missing field(s): {', '.join(missing)}")
        known = {*required, "args", "tp_degree", "isa", "max_parallel_rank_compiles", "extract_limits", "lnc",
                 "neuron_config", "nxdi_model"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(unknown)}")

        target = data["target"]
        if target != "cpu" and target not in NEURON_TARGETS:
            raise RequestError(f"target: expected cpu or one of {sorted(NEURON_TARGETS)}, got {target!r}")
        family = "cpu" if target == "cpu" else "neuron"
        backend = data["backend"]
        if backend not in BACKEND_FORMATS[family]:
            raise RequestError(f"backend: {backend!r} does not compile for target {target}")
        model_format = data["model_format"]
        if model_format not in BACKEND_FORMATS[family][backend]:
            raise RequestError(f"model_format: backend {backend} does not take {model_format!r} models")

        paths = {}
        for name in ("model_path", "out_dir", "work_dir"):
            value = data[name]
            if not isinstance(value, str) or not Path(value).is_absolute():
                raise RequestError(f"{name}: expected an absolute path, got {value!r}")
            paths[name] = Path(value)

        raw_inputs = data["inputs"]
        # An NxDI compile has no shape bucket: its sequence buckets are in neuron_config (one compile unit,
        # inputs == []: issue 29's contract).
        nxdi = backend == "nxdi"
        if not isinstance(raw_inputs, list) or (not raw_inputs and not nxdi):
            raise RequestError("inputs: expected a non-empty list of {name, shape, dtype}")
        inputs = []
        for index, item in enumerate(raw_inputs):
            try:
                spec = InputSpec.model_validate(item)  # the spec's own rules for names, shapes, dtypes
            except ValidationError as exc:
                raise RequestError(f"inputs[{index}]: {exc.errors(include_url=False)[0]['msg']}") from None
            inputs.append(InputDesc(spec.name, tuple(spec.shape), spec.dtype))
        if len({i.name for i in inputs}) != len(inputs):
            raise RequestError("inputs: names must be unique")

        args = data.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RequestError("args: expected a list of strings")
        tp_degree = data.get("tp_degree", 1)
        if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
            raise RequestError("tp_degree: expected a positive integer")
        bound = data.get("max_parallel_rank_compiles")
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 1):
            raise RequestError("max_parallel_rank_compiles: expected a positive integer or null")
        lnc = data.get("lnc")
        if lnc is not None and (not isinstance(lnc, int) or isinstance(lnc, bool) or lnc < 1):
            raise RequestError("lnc: expected a positive integer or null")
        isa = data.get("isa")
        if isa is not None and not isinstance(isa, str):
            raise RequestError("isa: expected a string or null")
        sdk = data["sdk"]
        if not isinstance(sdk, str) or not sdk:
            raise RequestError("sdk: expected a release string")
        neuron_config = data.get("neuron_config")
        if nxdi and not isinstance(neuron_config, dict):
            raise RequestError("neuron_config: an nxdi compile needs the canonical NeuronConfig (an object)")
        if not nxdi and neuron_config is not None:
            raise RequestError("neuron_config: only an nxdi compile takes one")
        nxdi_model = data.get("nxdi_model")
        if nxdi_model is not None and (not isinstance(nxdi_model, str) or ":" not in nxdi_model):
            raise RequestError("nxdi_model: expected \"package.module:Class\" or null")
        return cls(
            backend=backend,
            target=target,
            sdk=sdk,
            model_path=paths["model_path"],
            model_format=model_format,
            inputs=tuple(inputs),
            args=tuple(args),
            tp_degree=tp_degree,
            isa=isa,
            out_dir=paths["out_dir"],
            work_dir=paths["work_dir"],
            max_parallel_rank_compiles=bound,
            extract_limits=ExtractLimits.from_json(data.get("extract_limits")),
            lnc=lnc,
            neuron_config=neuron_config,
            nxdi_model=nxdi_model,
        )


@dataclass(frozen=True)
class ArtifactFile:
    """One file a backend wrote under ``out_dir``; ``extra`` holds role-specific fields (e.g. ``rank``)."""

    path: str  # relative to out_dir, with "/" separators
    role: str  # "model" (loadable); "model-shard" / "weights-shard": one tensor-parallel rank (docs/api.md)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompileResult:
    """What a successful backend returns; the child adds sizes, digests and the compile time."""

    files: list[ArtifactFile]
    versions: dict[str, str]


class Backend(ABC):
    """A compiler backend: turns one :class:`CompileRequest` (one model, one shape bucket) into artifact files.

    Implementations set ``name`` (the spec's ``compiler.backend`` value) and implement :meth:`compile`,
    which writes files under ``request.out_dir`` (scratch under ``request.work_dir``) and returns a
    :class:`CompileResult` listing them with the exact tool versions used. They raise a
    :class:`BackendFailure` (see the module docstring); any other exception is classified by the runner.
    A backend runs once per process (the child), so it may set process-wide state such as environment
    variables.
    """

    name: ClassVar[str]

    @abstractmethod
    def compile(self, request: CompileRequest) -> CompileResult:
        """Compile ``request``'s model at its bucket's shapes into ``request.out_dir``."""
