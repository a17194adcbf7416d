"""OpenAPI 3.1, generated from the app's own routes and the pydantic models that validate requests.

Each API view declares its operation with :func:`operation` (summary, request model, response models,
parameters, problem statuses). :func:`build_spec` walks ``app.url_map``, so a route cannot exist without
appearing in the document, and collects every model's JSON Schema into ``components.schemas`` through
pydantic (``models_json_schema``), so the schemas are those the code enforces: the request body of
POST /v1/builds *is* :class:`compilesvc.spec.CompileSpec`'s schema.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from flask import Flask
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from compilesvc import __version__
from web.problems import PROBLEM_TYPES, ProblemType
from web.schemas import ProblemDetails

F = TypeVar("F", bound=Callable[..., Any])
REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Param:
    name: str
    location: Literal["query", "header", "path"]
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Op:
    summary: str
    tag: str
    description: str = ""
    request: type[BaseModel] | None = None
    request_media: str = "application/json"
    request_schema: dict[str, Any] | None = None  # for non-JSON bodies (uploads)
    responses: dict[int, type[BaseModel] | str] = field(default_factory=dict)  # str: a media type
    problems: Sequence[int] = ()
    params: Sequence[Param] = ()
    query_model: type[BaseModel] | None = None
    headers: dict[int, dict[str, str]] = field(default_factory=dict)  # status -> {header: description}


def operation(**kwargs: Any) -> Callable[[F], F]:
    """Attach OpenAPI metadata to a view function."""
    op = Op(**kwargs)

    def wrap(view: F) -> F:
        view._openapi = op  # type: ignore[attr-defined]
        return view

    return wrap


_CONVERTER = re.compile(r"<(?:(?P<conv>\w+)(?:\([^)]*\))?:)?(?P<name>\w+)>")
_PATH_TYPES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer", "minimum": 1},
    "build_id": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
    "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
}


def _openapi_path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    params = []
    for match in _CONVERTER.finditer(rule):
        schema = _PATH_TYPES.get(match["conv"] or "", {"type": "string"})
        params.append({"name": match["name"], "in": "path", "required": True, "schema": schema})
    return _CONVERTER.sub(lambda m: "{" + m["name"] + "}", rule), params


def _query_params(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=REF)
    out = []
    for name, prop in schema.get("properties", {}).items():
        prop = dict(prop)
        description = prop.pop("description", None)
        prop.pop("title", None)
        param: dict[str, Any] = {"name": name, "in": "query", "required": name in schema.get("required", ()),
                                 "schema": prop}
        if description:
            param["description"] = description
        out.append(param)
    return out


def _problem_ref(status: int) -> dict[str, Any]:
    kinds: list[ProblemType] = [t for t in PROBLEM_TYPES.values() if t.status == status]
    text = "; ".join(f"`{t.code}`: {t.title}" for t in kinds) or "HTTP error"
    return {"description": text,
            "content": {"application/problem+json": {"schema": {"$ref": REF.format(model="ProblemDetails")}}}}


def build_spec(app: Flask) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``app``."""
    views = app.view_functions
    operations: list[tuple[str, str, Op, list[dict[str, Any]]]] = []
    models: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {(ProblemDetails, "serialization"): None}
    for rule in app.url_map.iter_rules():
        op: Op | None = getattr(views.get(rule.endpoint), "_openapi", None)
        if op is None:
            continue
        path, path_params = _openapi_path(rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            operations.append((path, method.lower(), op, path_params))
        if op.request is not None:
            models[(op.request, "validation")] = None
        for response in op.responses.values():
            if isinstance(response, type):
                models[(response, "serialization")] = None
    refs, top = models_json_schema(list(models), ref_template=REF)

    paths: dict[str, dict[str, Any]] = {}
    for path, method, op, path_params in sorted(operations, key=lambda o: (o[0], o[1])):
        item: dict[str, Any] = {"summary": op.summary, "tags": [op.tag],
                                "operationId": f"{method}_{re.sub(r'[^a-zA-Z0-9]+', '_', path).strip('_')}"}
        if op.description:
            item["description"] = op.description
        params = list(path_params)
        if op.query_model is not None:
            params += _query_params(op.query_model)
        for p in op.params:
            params.append({"name": p.name, "in": p.location, "required": p.required or p.location == "path",
                           "description": p.description, "schema": p.schema})
        if params:
            item["parameters"] = params
        if op.request is not None:
            item["requestBody"] = {"required": True, "content": {
                op.request_media: {"schema": refs[(op.request, "validation")]}}}
        elif op.request_schema is not None:
            item["requestBody"] = {"required": True, "content": {op.request_media: {"schema": op.request_schema}}}
        responses: dict[str, Any] = {}
        for status, response in sorted(op.responses.items()):
            entry: dict[str, Any] = {"description": _describe_status(status, response)}
            if isinstance(response, type):
                entry["content"] = {"application/json": {"schema": refs[(response, "serialization")]}}
            else:
                entry["content"] = {response: {"schema": {"type": "string"}}}
            if status in op.headers:
                entry["headers"] = {name: {"description": text, "schema": {"type": "string"}}
                                    for name, text in op.headers[status].items()}
            responses[str(status)] = entry
        for status in sorted({*op.problems, 500}):
            responses[str(status)] = _problem_ref(status)
        item["responses"] = responses
        paths.setdefault(path, {})[method] = item

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "compilesvc",
            "version": __version__,
            "description": "Compile-artifact service for AWS Neuron (inf2/trn) and CPU targets. Errors are "
                           "RFC 9457 problem details (application/problem+json).",
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": paths,
        "components": {"schemas": top.get("$defs", {})},
    }


def _describe_status(status: int, response: type[BaseModel] | str) -> str:
    name = response.__name__ if isinstance(response, type) else response
    return {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content"}.get(status, str(status)) + f" ({name})"
