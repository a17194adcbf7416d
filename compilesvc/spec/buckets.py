"""Shape buckets: the static input shapes one compile is for (:class:`Bucket`, :class:`InputSpec`, the
``{batch_size, seq_len}`` shorthand), the bounds on them (rank, dimensions, and the element limits a service
sets: :class:`ElementLimits`), and what every model of the spec shares (strict, frozen; errors that name a
field below the model)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

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
