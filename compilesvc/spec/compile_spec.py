"""CompileSpec: the public contract of a compile request, and its validation.

A spec names a model, a target chip, an SDK release, compiler options and the shape buckets to compile.
Validation is strict (unknown fields are refused) and every error names the field and what was expected;
:func:`parse_spec` turns pydantic's errors into :class:`SpecError` with that list.
"""

from __future__ import annotations

import re
import shlex
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from compilesvc.spec.buckets import (
    MAX_BUCKETS,
    Bucket,
    _FieldError,
    _integral,
    _Strict,
)
from compilesvc.spec.flags import (
    FlagError,
    canonical_flags,
    check_neuron_flags,
    flag_names,
    model_builder_problems,
    uses_model_builder,
)
from compilesvc.spec.neuron_kinds import NotShipped, TargetNotSupported, require_nxdi_target, require_target
from compilesvc.spec.neuron_releases import TARGET_FAMILIES, UnknownRelease
from compilesvc.spec.neuron_toolchain import toolchain_material
from compilesvc.spec.nxdi_config import NeuronConfigError, canonical_neuron_config

Target = Literal["inf2", "trn1", "trn2", "trn3", "cpu"]
ModelFormat = Literal["torchscript", "exported-program", "hf-dir", "hlo", "hf-checkpoint"]

#: Which releases support each one: the release table (:func:`compilesvc.spec.neuron_kinds.release_targets`).
NEURON_TARGETS: frozenset[str] = frozenset(TARGET_FAMILIES)
#: backend -> model formats it can compile
BACKEND_FORMATS: dict[str, dict[str, frozenset[str]]] = {
    "neuron": {
        "trace": frozenset({"torchscript", "exported-program", "hf-dir"}),
        "neuronx-cc": frozenset({"hlo"}),
        # An LLM compiled by NxD Inference from a Hugging Face checkpoint (docs/llm.md).
        "nxdi": frozenset({"hf-checkpoint"}),
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
# An hf-checkpoint model may name a prefix (ending in "/"); ModelRef refuses one for every other format.
_S3_FORM = "s3://[a-z0-9][a-z0-9.\\-]{1,61}[a-z0-9]/[^\\n\\u0000]*[^\\n\\u0000]"
# No host, query or fragment: a literal "#" or "?" in a file name is percent-encoded.
_FILE_FORM = "file:///[^?#\\u0000]*"
_URI_PATTERN = f"^({_BLOB_FORM}|{_S3_FORM}|{_FILE_FORM})$"
_BLOB_RE, _S3_RE, _FILE_RE = (re.compile(form) for form in (_BLOB_FORM, _S3_FORM, _FILE_FORM))
# Neuron SDK and torch releases are major.minor.patch; "2.20" names a series, not a release, and would
# otherwise be a second key (and an unserved queue) for the same toolchain.
#: (public: workers check the release they are configured with; use fullmatch.)
SDK_RE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")
#: ``<arch>-<level>``, as :func:`compilesvc.hostinfo.host_isa` reports it (public: the CLI checks --isa;
#: use fullmatch).
ISA_RE = re.compile(r"[a-z0-9_]+-[a-z0-9_]+")


#: The validation-context entry that carries option names accepted beyond neuronx-cc's table (the setting
#: COMPILESVC_EXTRA_COMPILER_FLAGS), or None to leave neuron flags to the service that receives the spec.
EXTRA_FLAGS_CONTEXT = "extra_compiler_flags"


class ModelRef(_Strict):
    # 1024: what the ledger keeps of a model's URI (model_pins, pin_jobs); an S3 key is at most 1024 bytes itself.
    uri: str = Field(description='"blob:sha256:<64 hex>", "s3://bucket/key" or "file:///abs/path"; an hf-checkpoint '
                     'may be "s3://bucket/prefix/" or a directory.', max_length=1024,
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
                raise ValueError("expected s3://bucket/key naming one object (not a prefix), or s3://bucket/prefix/ "
                                 "for an hf-checkpoint")
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
        if self.is_prefix and self.format != "hf-checkpoint":
            raise _FieldError(("uri",), "expected s3://bucket/key naming one object (not a prefix): only an "
                              "hf-checkpoint model may be a prefix")
        if self.is_prefix and self.version_id is not None:
            raise _FieldError(("version_id",), "a prefix is pinned object by object at submit; version_id names one "
                              "object")
        return self

    @property
    def is_prefix(self) -> bool:
        """An S3 prefix (a checkpoint directory in S3), pinned object by object at submit."""
        return self.uri.startswith("s3://") and self.uri.endswith("/")

    @property
    def scheme(self) -> str:
        return self.uri.split(":", 1)[0]


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
    buckets: list[Bucket] = Field(default_factory=list, max_length=MAX_BUCKETS, description="Shape buckets, at "
                                  "least one; none for hf-checkpoint models, whose sequence buckets are in "
                                  "neuron_config.")
    neuron_config: dict[str, Any] | None = Field(
        default=None, description="hf-checkpoint models only: NxD Inference's NeuronConfig, checked field by field "
        "against the NxDI release the SDK release ships (docs/llm.md).")
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
        if self.model.format == "hf-checkpoint":
            if family == "cpu":
                raise _FieldError(("model", "format"), "an hf-checkpoint is compiled by NxD Inference, for a Neuron "
                                  f"target ({', '.join(sorted(NEURON_TARGETS))}), not for cpu")
            if self.buckets:
                raise _FieldError(("buckets",), "an hf-checkpoint model takes its sequence buckets in "
                                  "neuron_config.buckets (e.g. [128, 512, 2048]), not shape buckets")
            if self.neuron_config is None:
                raise _FieldError(("neuron_config",), "required for an hf-checkpoint model (tp_degree, batch_size, "
                                  "seq_len, ...)")
        else:
            if not self.buckets:
                raise _FieldError(("buckets",), "Field required: at least 1 shape bucket (hf-checkpoint "
                                  "models take none)")
            if self.neuron_config is not None:
                raise _FieldError(("neuron_config",), "applies only to hf-checkpoint models (NxD Inference)")
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
        elif backend == "nxdi":
            self._check_nxdi(info)
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
        # NxD runs tp > 1 traces (not HLO compiles); from 2.21 through ModelBuilder's one flags string.
        if self.compiler.tp_degree > 1 and self.backend == "trace" and uses_model_builder(self.sdk):
            problems = sorted([*problems, *model_builder_problems(self.compiler.args)], key=lambda p: p.item)
        if problems:
            # One error (a model validator raises once), at the first bad item, naming every bad flag.
            raise _FieldError(("compiler", "args", problems[0].item), "; ".join(p.message for p in problems))
        # The key names the toolchain the release resolves to (docs/keys.md), so a release the release table
        # does not know cannot be keyed: say so here, where the user can act on it. After the flags, whose
        # check of a release newer than the table still names a misspelt option.
        try:
            toolchain_material(self.sdk, self.backend, self.compiler.tp_degree)
            require_target(self.sdk, self.target)
        except UnknownRelease as exc:
            raise _FieldError(("sdk",), str(exc)) from None
        except NotShipped as exc:
            raise _FieldError(("compiler", "backend"), str(exc)) from None
        except TargetNotSupported as exc:
            raise _FieldError(("target",), str(exc)) from None

    def _check_nxdi(self, info: ValidationInfo) -> None:
        """An NxD Inference compile: NxDI makes the compiler's flags and the tp degree from neuron_config, which
        is checked against the release's NeuronConfig table (compilesvc.spec.nxdi_config)."""
        if self.compiler.args:
            raise _FieldError(("compiler", "args", 0), "NxD Inference builds the compiler's flags from neuron_config "
                              "(models/model_wrapper.py); set them there instead (logical_nc_config, "
                              "cc_pipeline_tiling_factor, scratchpad_page_size, enable_spill_reload_dge, ...) and "
                              "leave compiler.args empty")
        if self.compiler.tp_degree != 1:
            raise _FieldError(("compiler", "tp_degree"), "an NxD Inference compile takes its tp degree from "
                              "neuron_config.tp_degree; leave compiler.tp_degree at 1")
        context = info.context if isinstance(info.context, dict) else {}
        try:
            toolchain_material(self.sdk, "nxdi", 1)
            require_nxdi_target(self.sdk, self.target)
        except (UnknownRelease, NotShipped, TargetNotSupported) as exc:
            if context.get(EXTRA_FLAGS_CONTEXT, frozenset()) is None:
                # A client leaves what its own release table cannot tell to the service (as _check_neuron_flags
                # does), whose table may be newer; a release it knows, it checks as the service would.
                return
            field = {UnknownRelease: ("sdk",), NotShipped: ("compiler", "backend")}.get(type(exc), ("target",))
            raise _FieldError(field, str(exc)) from None
        try:
            canonical_neuron_config(self.sdk, self.target, self.neuron_config or {})
        except NeuronConfigError as exc:
            raise _FieldError(("neuron_config", *exc.field), exc.message) from None

    @property
    def tp_degree(self) -> int:
        """The tp degree of this compile: neuron_config.tp_degree for an NxD Inference compile (whose
        compiler.tp_degree stays 1), compiler.tp_degree otherwise."""
        if self.backend == "nxdi":
            return int(self.nxdi_config.get("tp_degree", 1))
        return self.compiler.tp_degree

    @cached_property
    def document(self) -> dict[str, Any]:
        """The spec as every build of it records it (``builds.spec``): made once per spec, since a prepared spec
        is kept for its identical submits (and the spec is frozen). Shared: callers must not change it."""
        return self.model_dump(mode="json", exclude_none=True)

    @cached_property
    def nxdi_config(self) -> dict[str, Any]:
        """The canonical NeuronConfig of an hf-checkpoint spec (every default of its NxDI release filled in, the
        bucket short form expanded): what the key holds and the worker gives NxDI. Empty for other specs."""
        if self.neuron_config is None:
            return {}
        return canonical_neuron_config(self.sdk, self.target, self.neuron_config)

    @property
    def backend(self) -> str:
        """The compiler backend, with the per-target default filled in."""
        if self.compiler.backend:
            return self.compiler.backend
        if self.target == "cpu":
            return "torchscript"
        return {"hlo": "neuronx-cc", "hf-checkpoint": "nxdi"}.get(self.model.format, "trace")
