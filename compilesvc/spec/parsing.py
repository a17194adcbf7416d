"""Reading a spec: a decoded JSON/YAML document or a spec file into a validated
:class:`~compilesvc.spec.CompileSpec`, or a :class:`SpecError` listing ``{field, message}`` per problem with
dotted/indexed field paths (what the API's 422 and the CLI's one-line errors show)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from compilesvc.spec.buckets import DEFAULT_LIMITS, LIMITS_CONTEXT, ElementLimits, _FieldError
from compilesvc.spec.compile_spec import EXTRA_FLAGS_CONTEXT, CompileSpec


class SpecError(ValueError):
    """A spec that does not validate; ``errors`` lists ``{field, message}`` per problem."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        first = errors[0] if errors else {"field": "", "message": "invalid spec"}
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{first['field'] or 'spec'}: {first['message']}{more}")


_PLAIN_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]" or part.startswith("function-"):
            # "[key]" marks an error in a dict's key (labels); the key itself is the previous part.
            # "function-…" parts name pydantic's wrapper validators, not fields.
            continue
        elif not _PLAIN_KEY_RE.match(part):
            path += f"[{json.dumps(part, ensure_ascii=False)}]"  # a label key such as "" or "a.b"
        else:
            path += f".{part}" if path else part
    return path


def validation_errors(exc: ValidationError) -> list[dict[str, str]]:
    """pydantic errors as ``[{field, message}]`` with dotted/indexed field paths."""
    out = []
    for err in exc.errors(include_url=False):
        message = err["msg"]
        loc = tuple(err["loc"])
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, _FieldError):
            loc += cause.path
            message = str(cause)
        elif err["type"] == "extra_forbidden":
            message = "unknown field"
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        elif err["type"] == "string_type" and isinstance(err.get("input"), (int, float)) \
                and not isinstance(err.get("input"), bool):
            # YAML reads `sdk: 2.20` as the number 2.2: the digits the user wrote are gone by now.
            name = _field_path(loc).rsplit(".", 1)[-1]
            message = f"expected a string, got the number {err['input']!r}: put the value in quotes ({name}: \"...\")"
            if isinstance(err["input"], float):
                message += "; unquoted, YAML reads 2.20 as the number 2.2"
        out.append({"field": _field_path(loc), "message": message})
    return out


def parse_spec(data: Any, limits: ElementLimits | None = DEFAULT_LIMITS,
               extra_flags: Iterable[str] | None = ()) -> CompileSpec:
    """Validate a decoded JSON/YAML document as a CompileSpec, raising :class:`SpecError`.

    ``limits`` bounds the elements of inputs and buckets (None: unbounded, for a client that leaves the
    bounds to the service it submits to). Neuron flags are checked against neuronx-cc's options for the
    spec's SDK release, plus the option names in ``extra_flags`` (None: not checked, for the same client).
    """
    if not isinstance(data, dict):
        raise SpecError([{"field": "", "message": "expected a JSON object"}])
    try:
        extra = None if extra_flags is None else frozenset(extra_flags)
        return CompileSpec.model_validate(data, context={LIMITS_CONTEXT: limits, EXTRA_FLAGS_CONTEXT: extra})
    except ValidationError as exc:
        raise SpecError(validation_errors(exc)) from None


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    # str() of a YAML error spans lines, with a source excerpt and a caret; errors are reported on one line.
    text = ": ".join(part for part in (exc.context, exc.problem) if part) or "syntax error"
    mark = exc.problem_mark or exc.context_mark
    return f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text


def load_spec_file(path: str | Path, limits: ElementLimits | None = DEFAULT_LIMITS,
                   extra_flags: Iterable[str] | None = ()) -> CompileSpec:
    """Read a spec from a .json, .yaml or .yml file (the CLI's input), validated as :func:`parse_spec`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([{"field": "", "message": f"cannot read {path}: {exc.strerror}"}]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([{"field": "", "message": f"{path} is not UTF-8 text: {exc.reason}"}]) from None
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:
        kind = "YAML" if is_yaml else "JSON"
        detail = _yaml_problem(exc) if isinstance(exc, yaml.MarkedYAMLError) else " ".join(str(exc).split())
        raise SpecError([{"field": "", "message": f"{path} is not valid {kind}: {detail}"}]) from None
    return parse_spec(data, limits, extra_flags)
