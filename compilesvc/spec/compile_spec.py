"""CompileSpec: the public contract of a compile request, and its validation.

A spec names a model, a target chip, an SDK release, compiler options and the shape buckets to compile.
Validation is strict (unknown fields are refused) and every error names the field and what was expected;
:func:`parse_spec` turns pydantic's errors into :class:`SpecError` with that list.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from compilesvc.spec.flags import FlagError, canonical_flags, check_neuron_flags, flag_names, whitespace_problems
from compilesvc.spec.neuron_releases import NotShipped, UnknownRelease, toolchain_material

Target = Literal["inf2", "trn1", "trn2", "cpu"]
ModelFormat = Literal["torchscript", "exported-program", "hf-dir", "hlo"]
DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]

NEURON_TARGETS: frozenset[str] = frozenset({"inf2", "trn1", "trn2"})
#: backend -> model formats it can compile
BACKEND_FORMATS: dict[str, dict[str, frozenset[str]]] = {
    "neuron": {
        "trace": frozenset({"torchscript", "exported-program", "hf-dir"}),
        "neuronx-cc": frozenset({"hlo"}),
    },
    "cpu": {
        "torchscript": frozenset({"torchscript", "exported-program", "hf-dir"}),
        "aotinductor": frozenset({"exported-program", "hf-dir"}),
    },
}
#: flags the cpu backends understand; neuron flags are checked against neuronx-cc's options table
#: (compilesvc.spec.neuronx_cc_options) for the spec's SDK release and target.
CPU_BACKEND_FLAGS: dict[str, frozenset[str]] = {
    "torchscript": frozenset({"--freeze", "--optimize-for-inference"}),
    "aotinductor": frozenset({"--freezing", "--max-autotune"}),
}

# The forms of the spec's text fields. Each is checked with re.fullmatch and published as the field's JSON
# Schema ``pattern`` (anchored), so it is written in the subset Python and ECMA-262 read alike: explicit
# character classes, no ``.``, ``\d`` or ``$`` (whose meanings differ between the two).
_BLOB_FORM = "blob:sha256:[0-9a-f]{64}"
_S3_FORM = "s3://[a-z0-9][a-z0-9.\\-]{1,61}[a-z0-9]/[^\\n\\u0000]*[^/\\n\\u0000]"
# No host, query or fragment: a literal "#" or "?" in a file name is percent-encoded.
_FILE_FORM = "file:///[^?#\\u0000]*"
_URI_PATTERN = f"^({_BLOB_FORM}|{_S3_FORM}|{_FILE_FORM})$"
_BLOB_RE, _S3_RE, _FILE_RE = (re.compile(form) for form in (_BLOB_FORM, _S3_FORM, _FILE_FORM))
# Neuron SDK and torch releases are major.minor.patch; "2.20" names a series, not a release, and would
# otherwise be a second key (and an unserved queue) for the same toolchain.
#: (public: workers check the release they are configured with; use fullmatch.)
SDK_RE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: ``<arch>-<level>``, as :func:`compilesvc.hostinfo.host_isa` reports it (public: the CLI checks --isa;
#: use fullmatch).
ISA_RE = re.compile(r"[a-z0-9_]+-[a-z0-9_]+")


MAX_BUCKETS = 64
MAX_RANK = 8
MAX_DIM = 1 << 20

# Rank and dimension bounds alone still allow [2**20]*8 = 2**160 elements, which no compiler can allocate:
# each compile attempt fails ("Storage size calculation overflowed") and, looking like an infrastructure
# failure, is retried. So the element count is bounded too. The defaults are generous for real models: the
# largest input of a long-context LLM bucket, hidden states [64, 32768, 8192], is 2**34 elements (32 GiB in
# bfloat16, more than one accelerator holds), and a bucket may hold a few inputs of that size. They are
# settings (COMPILESVC_MAX_ELEMENTS_PER_INPUT/_PER_BUCKET); the key never depends on them.
DEFAULT_MAX_ELEMENTS_PER_INPUT = 2**34
DEFAULT_MAX_ELEMENTS_PER_BUCKET = 2**36


@dataclass(frozen=True)
class ElementLimits:
    """Most elements (the product of a shape's dimensions) one input, and all inputs of a bucket, may hold."""

    per_input: int = DEFAULT_MAX_ELEMENTS_PER_INPUT
    per_bucket: int = DEFAULT_MAX_ELEMENTS_PER_BUCKET


DEFAULT_LIMITS = ElementLimits()
#: The validation-context entry that carries the :class:`ElementLimits` (None: unbounded).
LIMITS_CONTEXT = "element_limits"
#: The validation-context entry that carries option names accepted beyond neuronx-cc's table (the setting
#: COMPILESVC_EXTRA_COMPILER_FLAGS), or None to leave neuron flags to the service that receives the spec.
EXTRA_FLAGS_CONTEXT = "extra_compiler_flags"


def _limits(info: ValidationInfo) -> ElementLimits | None:
    context = info.context if isinstance(info.context, dict) else {}
    limits = context.get(LIMITS_CONTEXT, DEFAULT_LIMITS)
    return limits if isinstance(limits, ElementLimits) else None


def _too_many(count: int, limit: int, what: str, setting: str) -> str:
    return f"{count} elements {what}; at most {limit} are accepted ({setting})"


# Strict: a shape is written as integers. Lax mode would quietly read true, "3" and 3.0 as dimensions.
def _integral(value: Any) -> Any:
    """JSON Schema's integer is any number without a fraction: 2.0 is the integer 2 (and keys like it).
    Everything else is left to strict int validation, which refuses booleans and strings."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Dim = Annotated[int, Field(strict=True, ge=1, le=MAX_DIM), BeforeValidator(_integral)]


class _FieldError(ValueError):
    """A validator's complaint about a field *below* the model being validated.

    pydantic locates errors raised by a model validator at the model itself (the top-level spec has the empty
    path), so a cross-field check would name no field. ``path`` is relative to the model;
    :func:`validation_errors` appends it to pydantic's location.
    """

    def __init__(self, path: tuple[str | int, ...], message: str):
        self.path = path
        super().__init__(message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    uri: str = Field(description='"blob:sha256:<64 hex>", "s3://bucket/key" or "file:///abs/path".',
                     json_schema_extra={"pattern": _URI_PATTERN})
    format: ModelFormat
    name: str | None = Field(default=None, max_length=200, description="Display only; not in the key.")
    version_id: str | None = Field(default=None, max_length=1024, description="S3 object version (s3 only).")

    @field_validator("uri")
    @classmethod
    def _uri_form(cls, uri: str) -> str:
        if _BLOB_RE.fullmatch(uri):
            return uri
        if uri.startswith("s3://"):
            if not _S3_RE.fullmatch(uri):
                raise ValueError("expected s3://bucket/key naming one object (not a prefix)")
            return uri
        if uri.startswith("file://"):
            if not _FILE_RE.fullmatch(uri):
                raise ValueError("expected file:///absolute/path")
            return uri
        if uri.startswith("blob:"):
            raise ValueError("expected blob:sha256:<64 lowercase hex digits>")
        raise ValueError('expected "blob:sha256:<hex>", "s3://bucket/key" or "file:///abs/path"')

    @model_validator(mode="after")
    def _version_only_for_s3(self) -> ModelRef:
        if self.version_id is not None and not self.uri.startswith("s3://"):
            raise _FieldError(("version_id",), "applies only to s3:// models")
        return self

    @property
    def scheme(self) -> str:
        return self.uri.split(":", 1)[0]


class InputSpec(_Strict):
    name: str = Field(description="Argument name of the model's forward().",
                      json_schema_extra={"pattern": f"^{_NAME_RE.pattern}$"})
    shape: list[Dim] = Field(
        max_length=MAX_RANK,
        description=f"Dimensions. Their product (the input's elements) is at most the service's "
        f"max_elements_per_input (default {DEFAULT_MAX_ELEMENTS_PER_INPUT}); a bucket's inputs together hold "
        f"at most max_elements_per_bucket (default {DEFAULT_MAX_ELEMENTS_PER_BUCKET}) elements.",
    )
    dtype: DType

    @field_validator("name")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not _NAME_RE.fullmatch(name):
            raise ValueError("expected a Python identifier of at most 64 characters")
        return name


def _document_shorthand(schema: dict[str, Any]) -> None:
    """A bucket's JSON Schema: its inputs, or the {batch_size, seq_len} shorthand :meth:`Bucket._shorthand`
    reads."""
    full = {key: schema.pop(key) for key in list(schema) if key not in ("title", "description")}
    dim = {"type": "integer", "minimum": 1, "maximum": MAX_DIM}
    schema["anyOf"] = [full, {
        "type": "object", "additionalProperties": False, "required": ["batch_size", "seq_len"],
        "properties": {"batch_size": dim, "seq_len": dim},
        "description": "Shorthand for inputs input_ids and attention_mask, int64, [batch_size, seq_len]."}]


class Bucket(_Strict):
    """One static input shape set: one compile, one artifact file set."""

    model_config = ConfigDict(json_schema_extra=_document_shorthand)

    inputs: list[InputSpec] = Field(min_length=1, max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any, info: ValidationInfo) -> Any:
        # {batch_size, seq_len} is the common transformer bucket: input_ids and attention_mask.
        if isinstance(data, dict) and ("batch_size" in data or "seq_len" in data):
            # Errors name the shorthand's own fields: the expanded inputs are not what the user wrote.
            extras = sorted(map(str, set(data) - {"batch_size", "seq_len"}))
            if extras:
                raise _FieldError(
                    (extras[0],), "unknown field (the shorthand takes exactly batch_size and seq_len)"
                )
            shape = []
            for name in ("batch_size", "seq_len"):
                if name not in data:
                    raise _FieldError((name,), "the shorthand needs both batch_size and seq_len")
                value = _integral(data[name])
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
                    raise _FieldError((name,), f"expected an integer from 1 to {MAX_DIM}")
                shape.append(value)
            # Checked here, so the error names the bucket the user wrote rather than the expanded inputs.
            limits = _limits(info)
            count = shape[0] * shape[1]
            if limits is not None and count > limits.per_input:
                what = "per input (batch_size * seq_len)"
                raise _FieldError((), _too_many(count, limits.per_input, what, "max_elements_per_input"))
            if limits is not None and 2 * count > limits.per_bucket:
                what = "in the bucket (input_ids and attention_mask)"
                raise _FieldError((), _too_many(2 * count, limits.per_bucket, what, "max_elements_per_bucket"))
            return {
                "inputs": [
                    {"name": "input_ids", "shape": shape, "dtype": "int64"},
                    {"name": "attention_mask", "shape": shape, "dtype": "int64"},
                ]
            }
        return data

    @field_validator("inputs")
    @classmethod
    def _unique_names(cls, inputs: list[InputSpec]) -> list[InputSpec]:
        seen: set[str] = set()
        for index, spec in enumerate(inputs):
            if spec.name in seen:
                raise _FieldError((index, "name"), f"duplicate input name {spec.name!r} within the bucket")
            seen.add(spec.name)
        return inputs

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> Bucket:
        limits = _limits(info)
        if limits is None:
            return self
        total = 0
        for index, spec in enumerate(self.inputs):
            count = math.prod(spec.shape)  # at most (2**20)**8: a Python int, never an overflow
            if count > limits.per_input:
                raise _FieldError(("inputs", index, "shape"),
                                  _too_many(count, limits.per_input, "per input", "max_elements_per_input"))
            total += count
        if total > limits.per_bucket:
            raise _FieldError(("inputs",), _too_many(total, limits.per_bucket, "in the bucket's inputs together",
                                                     "max_elements_per_bucket"))
        return self


class CompilerOptions(_Strict):
    backend: str | None = Field(
        default=None,
        description="neuron targets: trace (default) or neuronx-cc (hlo models); "
        "cpu: torchscript (default) | aotinductor.",
    )
    args: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list, max_length=128)
    tp_degree: Annotated[int, Field(strict=True, ge=1, le=128), BeforeValidator(_integral)] = 1
    isa: str | None = Field(
        default=None,
        description="cpu aotinductor only: instruction set the native code targets, e.g. x86_64-avx512. "
        "Defaults to the API host's.",
        json_schema_extra={"pattern": f"^{ISA_RE.pattern}$"},
    )

    @field_validator("args")
    @classmethod
    def _splittable(cls, args: list[str]) -> list[str]:
        # Checked for every target: an unreadable item must fail here, with its index, not later when the
        # key is computed (neuron targets never reach the cpu allowlist check below).
        for index, item in enumerate(args):
            try:
                shlex.split(item)
            except ValueError as exc:
                raise _FieldError((index,), f"cannot split {item!r} shell-style: {exc}") from None
        return args

    @field_validator("isa")
    @classmethod
    def _isa_form(cls, isa: str | None) -> str | None:
        if isa is not None and not ISA_RE.fullmatch(isa):
            raise ValueError("expected <arch>-<isa>, e.g. x86_64-avx512")
        return isa


LabelKey = Annotated[str, Field(min_length=1, max_length=64)]
LabelValue = Annotated[str, Field(max_length=1024)]


class CompileSpec(_Strict):
    model: ModelRef
    target: Target
    sdk: str = Field(description='Neuron SDK release, e.g. "2.20.0"; for cpu the torch version.',
                     json_schema_extra={"pattern": f"^{SDK_RE.pattern}$"})
    compiler: CompilerOptions = Field(default_factory=CompilerOptions)
    buckets: list[Bucket] = Field(min_length=1, max_length=MAX_BUCKETS)
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Recorded with the build; never in the key."
    )
    callbacks: list[Annotated[str, Field(max_length=2048, pattern=r"^https?://[^\x00-\x20\x7f]+$")]] = Field(
        default_factory=list, max_length=5, description="URLs POSTed a signed event when the build ends (docs/api.md, "
        "Webhooks); never in the key.")

    @field_validator("sdk")
    @classmethod
    def _sdk_form(cls, sdk: str) -> str:
        if not SDK_RE.fullmatch(sdk):
            raise ValueError('expected a release number major.minor.patch, such as "2.20.0"')
        return sdk

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> CompileSpec:
        family = "cpu" if self.target == "cpu" else "neuron"
        backends = BACKEND_FORMATS[family]
        backend = self.backend
        if backend not in backends:
            raise _FieldError(
                ("compiler", "backend"),
                f"{backend!r} is not available for target {self.target}; expected one of {sorted(backends)}",
            )
        if self.model.format not in backends[backend]:
            raise _FieldError(
                ("model", "format"),
                f"{self.model.format!r} cannot be compiled by backend {backend!r}; "
                f"expected one of {sorted(backends[backend])}",
            )
        if family == "cpu":
            if self.compiler.tp_degree != 1:
                raise _FieldError(("compiler", "tp_degree"), "must be 1 for target cpu")
            try:
                unknown = flag_names(canonical_flags(self.compiler.args)) - CPU_BACKEND_FLAGS[backend]
            except FlagError as exc:  # pragma: no cover - CompilerOptions._splittable refuses these first
                raise _FieldError(("compiler", "args"), str(exc)) from None
            if unknown:
                raise _FieldError(
                    ("compiler", "args"),
                    f"{sorted(unknown)} are not understood by the cpu {backend} backend; "
                    f"expected some of {sorted(CPU_BACKEND_FLAGS[backend])}",
                )
        else:
            self._check_neuron_flags(info)
        if self.compiler.isa is not None and backend != "aotinductor":
            raise _FieldError(("compiler", "isa"), "applies only to the cpu aotinductor backend")
        return self

    def _check_neuron_flags(self, info: ValidationInfo) -> None:
        context = info.context if isinstance(info.context, dict) else {}
        extra = context.get(EXTRA_FLAGS_CONTEXT, frozenset())
        if extra is None:
            return
        try:
            problems = check_neuron_flags(self.compiler.args, sdk=self.sdk, target=self.target,
                                          extra=frozenset(extra))
        except FlagError as exc:  # pragma: no cover - CompilerOptions._splittable refuses these first
            raise _FieldError(("compiler", "args"), str(exc)) from None
        if self.compiler.tp_degree > 1 and self.backend == "trace":  # NxD runs tp > 1 traces, not HLO compiles
            problems = sorted([*problems, *whitespace_problems(self.compiler.args)], key=lambda p: p.item)
        if problems:
            # One error (a model validator raises once), at the first bad item, naming every bad flag.
            raise _FieldError(("compiler", "args", problems[0].item), "; ".join(p.message for p in problems))
        # The key names the toolchain the release resolves to (docs/keys.md), so a release the release table
        # does not know cannot be keyed: say so here, where the user can act on it. After the flags, whose
        # check of a release newer than the table still names a misspelt option.
        try:
            toolchain_material(self.sdk, self.backend, self.compiler.tp_degree)
        except UnknownRelease as exc:
            raise _FieldError(("sdk",), str(exc)) from None
        except NotShipped as exc:
            raise _FieldError(("compiler", "backend"), str(exc)) from None

    @cached_property
    def document(self) -> dict[str, Any]:
        """The spec as every build of it records it (``builds.spec``): made once per spec, since a prepared spec
        is kept for its identical submits (and the spec is frozen). Shared: callers must not change it."""
        return self.model_dump(mode="json", exclude_none=True)

    @property
    def backend(self) -> str:
        """The compiler backend, with the per-target default filled in."""
        if self.compiler.backend:
            return self.compiler.backend
        if self.target == "cpu":
            return "torchscript"
        return "neuronx-cc" if self.model.format == "hlo" else "trace"
