"""Reading JSON request bodies into values or 400/422 problems, and writing JSON responses.

Everything here treats input as hostile: malformed JSON, deep nesting, NUL characters and lone UTF-16
surrogates (which Postgres refuses, and which would otherwise surface as a 500 deep in a query) are
turned into problem responses before any core code sees them.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

import orjson
from flask import Response, current_app, request
from pydantic import BaseModel, ValidationError

from compilesvc.config.settings import Settings
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.parsing import SpecError, parse_spec, validation_errors
from web.context import web
from web.contract.problems import Problem

M = TypeVar("M", bound=BaseModel)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A compact JSON response (cheaper than jsonify: no pretty-printing, no key sorting)."""
    response = Response(json.dumps(body, ensure_ascii=False, separators=(",", ":"), default=_default),
                        status=status, mimetype="application/json")
    if headers:
        for name, value in headers.items():
            response.headers[name] = value
    return response


def respond(model: type[BaseModel], body: dict[str, Any], status: int = 200,
            headers: dict[str, str] | None = None, *, embed: dict[str, bytes] | None = None) -> Response:
    """``body`` as the documented ``model`` (validated, then serialised from the model): a view cannot
    answer what /openapi.json does not describe (an undocumented field is an error here, not a drift).

    ``embed`` puts JSON that was validated and encoded already (the manifest cache's) into fields that
    ``body`` leaves null, as it is."""
    document = model.model_validate(body).model_dump(by_alias=True)
    for field, encoded in (embed or {}).items():
        document[field] = orjson.Fragment(encoded)
    return raw_json_response(orjson.dumps(document), status, headers)


def raw_json_response(text: str | bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A response whose body is already JSON text."""
    response = Response(text, status=status, mimetype="application/json")
    if headers:
        for name, value in headers.items():
            response.headers[name] = value
    return response


def _default(value: Any) -> Any:
    isoformat = getattr(value, "isoformat", None)
    if isoformat is not None:
        return isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _text_problems(data: Any) -> list[dict[str, str]]:
    """Strings (keys or values) holding NUL or unpaired surrogates, as {field, message}; iterative so
    that nesting depth cannot exhaust the stack."""
    problems: list[dict[str, str]] = []
    stack: list[tuple[str, Any]] = [("", data)]
    while stack and len(problems) < 20:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if _bad_text(key):
                    problems.append({"field": child.encode("utf-8", "replace").decode(),
                                     "message": "keys must be Unicode text without NUL characters"})
                else:
                    stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, str) and _bad_text(value):
            problems.append({"field": path.encode("utf-8", "replace").decode(),
                             "message": "must be Unicode text without NUL characters or lone surrogates"})
    return problems


def _bad_text(text: str) -> bool:
    if "\x00" in text:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def too_large(limit: int) -> Problem:
    return Problem("request-too-large", f"request bodies are limited to {limit} bytes", max_bytes=limit)


def read_body() -> bytes:
    """The whole request body, refusing more than ``MAX_CONTENT_LENGTH`` bytes with a 413.

    A declared Content-Length over the limit is refused by werkzeug before reading. A streamed (chunked)
    body is read here with one byte of headroom, because werkzeug's own ``read()`` silently stops at
    the limit and would hand a truncated body to the JSON parser.
    """
    limit: int | None = current_app.config.get("MAX_CONTENT_LENGTH")
    if request.content_length is not None or limit is None:
        return request.get_data(cache=False)
    request.max_content_length = limit + 1
    stream = request.stream
    chunks: list[bytes] = []
    total = 0
    while chunk := stream.read(min(64 * 1024, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
    return b"".join(chunks)


def body_text() -> str:
    """The request body as UTF-8 text; 400 ``invalid-json`` if it is not, 413 past the size limit."""
    raw = read_body()
    if not raw.strip():
        raise Problem("invalid-json", "the request body is empty; expected a JSON document")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Problem("invalid-json", f"the body is not UTF-8 (byte {exc.start})") from None


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise Problem("invalid-json", f"line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise Problem("invalid-json", "the document is nested too deeply") from None
    except ValueError as exc:  # Python refuses to convert integers of more than sys.get_int_max_str_digits()
        detail = (f"an integer has more than {sys.get_int_max_str_digits()} digits" if "digits" in str(exc)
                  else f"cannot decode the body: {exc}")
        raise Problem("invalid-json", detail) from None


def _refuse_unstorable_text(text: str, data: Any, problem: str) -> None:
    # The text is valid UTF-8 and JSON refuses raw control characters, so NUL and lone surrogates can
    # only come from \u escapes: without one, there is nothing to look for.
    bad_text = _text_problems(data) if "\\u" in text else []
    if bad_text:
        raise Problem(problem, f"{len(bad_text)} field(s) hold text that cannot be stored", errors=bad_text)


def model_body(model: type[M], problem: str) -> M:
    """The body as ``model``; 400 for malformed JSON, 422 ``problem`` with per-field errors otherwise."""
    text = body_text()
    data = _parse_json(text)
    _refuse_unstorable_text(text, data, problem)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc)
        raise Problem(problem, "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5]),
                      errors=errors) from None


def spec_body() -> CompileSpec:
    """The body as a validated CompileSpec; 422 ``spec-invalid`` with per-field errors otherwise."""
    return parse_spec_text(body_text())


def parse_for_service(data: Any, settings: Settings) -> CompileSpec:
    """:func:`~compilesvc.spec.parsing.parse_spec` with a service's own bounds on elements and its extra
    compiler flags (what the API and the campaigns it runs accept). Here, not in the spec package, which
    knows nothing of the service's settings."""
    return parse_spec(data, settings.element_limits, settings.extra_flags)


def parse_spec_text(text: str) -> CompileSpec:
    """:func:`spec_body` of body ``text`` already read."""
    data = _parse_json(text)
    _refuse_unstorable_text(text, data, "spec-invalid")
    try:
        # The service's bounds on elements per input and bucket: a shape no compiler can allocate is a 422
        # here, not three failed compile attempts.
        return parse_for_service(data, web().settings)
    except SpecError as exc:
        raise Problem("spec-invalid", str(exc), errors=exc.errors) from None
    except RecursionError:
        raise Problem("spec-invalid", "the document is nested too deeply",
                      errors=[{"field": "", "message": "nested too deeply"}]) from None
