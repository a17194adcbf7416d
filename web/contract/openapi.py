"""Each endpoint's declaration, which both validates its request and documents it in OpenAPI 3.1.

A view declares its operation with :func:`operation`: summary, query and header models
(:mod:`web.contract.inputs`), the request body's model, response models and problem statuses. The decorator reads
the query string and headers into their models before the view runs (400 ``invalid-request`` otherwise)
and passes them as ``query=`` and ``headers=``; :func:`build_spec` walks ``app.url_map``, so a route cannot
exist without appearing in the document, and collects every model's JSON Schema through pydantic
(``models_json_schema``). The document therefore says what the code enforces: the request body of
POST /v1/builds *is* :class:`compilesvc.spec.compile_spec.CompileSpec`'s schema, and a parameter is documented by the
model that reads it.

Why not a library: flask-openapi3 4.3 generates a model's JSON Schema on every request it validates, which
for the history query costs more than a whole artifact lookup (``python -m timeit -s 'from web.contract.inputs
import BuildListQuery' 'BuildListQuery.model_json_schema()'``: 0.8 to 1.4 ms on the 2-core CI machine,
against about 3 µs to validate the same query); and spectree 3.0 can
describe neither ``application/problem+json`` errors, response headers, raw upload bodies nor our path
converters, and reads a malformed JSON body as ``{}``. Both would need this module's document assembly
on top; what they would replace is the part pydantic already does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flask import Flask
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from compilesvc import __version__
from compilesvc.access.tokens import Permission
from compilesvc.config.settings import Settings
from web.contract.access import METRICS, PUBLIC, SIGNED_URL, checks_sent_token, needed
from web.contract.inputs import NO_NUL_PATTERN, read_headers, read_query
from web.contract.problems import PROBLEM_TYPES, ProblemType
from web.contract.schemas import ProblemDetails

F = TypeVar("F", bound=Callable[..., Any])
REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Op:
    summary: str
    tag: str  # one of TAGS
    description: str  # what the summary leaves out: the document has one for every operation
    request: type[BaseModel] | None = None
    request_media: str = "application/json"
    request_schema: dict[str, Any] | None = None  # for non-JSON bodies (uploads)
    #: A model (JSON), a media type (its body a string), or a media type and the schema of its body
    #: (for ``text/event-stream``, of each event).
    #: Per status: a model (JSON), a media type, (media type, schema), or None (no body: a 304).
    responses: dict[int, type[BaseModel] | str | tuple[str, dict[str, Any]] | None] = field(default_factory=dict)
    problems: Sequence[int] = ()
    query: type[BaseModel] | None = None
    headers: type[BaseModel] | None = None
    #: The problem a query that does not parse is (default 400 ``invalid-request``).
    invalid_query: str = "invalid-request"
    response_headers: dict[int, dict[str, str]] = field(default_factory=dict)  # status -> {header: description}
    #: Who may call it (:mod:`web.auth`): a :class:`compilesvc.access.tokens.Permission`, or public / signed-url /
    #: metrics. Checked before the view runs; None means admin.
    access: str | None = None


#: The document's tags, in the order readers see them: every operation's tag must be one of these.
TAGS: dict[str, str] = {
    "builds": "Submit compile specs and follow, cancel and retry the builds they start.",
    "logs": "A build's compile logs: pages to poll, or a live Server-Sent Events stream.",
    "models": "Upload the model files specs refer to.",
    "artifacts": "Published artifacts: manifests, download URLs, signatures and provenance; resolving a spec "
                 "to its keys without building.",
    "campaigns": "Roll published artifacts forward to another Neuron SDK release.",
    "retention": "Pins that keep artifacts from garbage collection.",
    "subscriptions": "Service-wide event subscriptions: signed webhooks for every build's changes.",
    "tokens": "API tokens: make, list and revoke them.",
    "system": "Health, readiness, metrics, and the workers and queues.",
}


def operation(**kwargs: Any) -> Callable[[F], F]:
    """Declare a view's operation: its query string and headers are read into their models before it runs
    (and passed as ``query=`` and ``headers=``), and the declaration is its OpenAPI description. A tag
    the document does not declare (:data:`TAGS`) or an operation without a description is refused here,
    when the module is imported, rather than published."""
    op = Op(**kwargs)
    if op.tag not in TAGS:
        raise ValueError(f"operation {op.summary!r}: tag {op.tag!r} is not one of web.contract.openapi.TAGS")
    if not op.description:
        raise ValueError(f"operation {op.summary!r}: no description (the document gives one for every operation)")

    def wrap(view: F) -> F:
        @functools.wraps(view)
        def validated(*args: Any, **path: Any) -> Any:
            if op.query is not None:
                path["query"] = read_query(op.query, op.invalid_query)
            if op.headers is not None:
                path["headers"] = read_headers(op.headers)
            return view(*args, **path)

        validated._openapi = op  # type: ignore[attr-defined]
        return validated  # type: ignore[return-value]

    return wrap


_CONVERTER = re.compile(r"<(?:(?P<conv>\w+)(?:\([^)]*\))?:)?(?P<name>\w+)>")
_PATH_TYPES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer", "minimum": 1},
    "ledger_id": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
    "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
}


def openapi_path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    """A werkzeug rule as an OpenAPI path (``/v1/builds/{build_id}``) and its path parameters."""
    params = []
    for match in _CONVERTER.finditer(rule):
        schema = _PATH_TYPES.get(match["conv"] or "", {"type": "string"})
        params.append({"name": match["name"], "in": "path", "required": True, "schema": schema})
    return _CONVERTER.sub(lambda m: "{" + m["name"] + "}", rule), params


def _model_params(model: type[BaseModel], location: str, defs: dict[str, Any]) -> list[dict[str, Any]]:
    """A query or header model's fields as OpenAPI parameters (by alias, as :mod:`web.contract.inputs` reads them);
    the schemas they refer to are added to ``defs``."""
    schema = model.model_json_schema(ref_template=REF, by_alias=True)
    defs.update(schema.get("$defs", {}))
    out = []
    for name, prop in schema.get("properties", {}).items():
        prop = _no_nul(_absent_not_null(dict(prop)))
        description = prop.pop("description", None)
        prop.pop("title", None)
        param: dict[str, Any] = {"name": name, "in": location, "required": name in schema.get("required", ()),
                                 "schema": prop}
        if description:
            param["description"] = description
        out.append(param)
    return out


def _absent_not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional parameter is one that may be left out, not one that may be sent as ``null``."""
    if "anyOf" not in schema:
        return schema
    options = [option for option in schema["anyOf"] if option.get("type") != "null"]
    rest = {k: v for k, v in schema.items() if k != "anyOf" and not (k == "default" and v is None)}
    return {**rest, **options[0]} if len(options) == 1 else {**rest, "anyOf": options}


def _no_nul(schema: Any, components: dict[str, Any] | None = None, seen: set[str] | None = None) -> Any:
    """Text without a pattern of its own says what the readers enforce for all text (query strings,
    headers, JSON bodies): no NUL characters. With ``components``, the schemas ``schema`` refers to are
    rewritten too, in place."""
    if isinstance(schema, list):
        return [_no_nul(item, components, seen) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and components is not None and seen is not None:
        name = ref.rsplit("/", 1)[-1]
        if name not in seen and name in components:
            seen.add(name)
            components[name] = _no_nul(components[name], components, seen)
        return schema
    out = {key: _no_nul(value, components, seen) if key in _SUBSCHEMAS else value for key, value in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: _no_nul(prop, components, seen) for name, prop in schema["properties"].items()}
    if "propertyNames" in schema:  # object keys are strings, whether or not the schema says so
        out["propertyNames"] = _no_nul({"type": "string", **schema["propertyNames"]})
    if schema.get("type") == "string" and "pattern" not in schema:
        out["pattern"] = NO_NUL_PATTERN
    return out


_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "items", "additionalProperties", "propertyNames", "prefixItems")


def _problem_ref(status: int) -> dict[str, Any]:
    kinds: list[ProblemType] = [t for t in PROBLEM_TYPES.values() if t.status == status]
    text = "; ".join(f"`{t.code}`: {t.title}" for t in kinds) or "HTTP error"
    out: dict[str, Any] = {
        "description": text,
        "content": {"application/problem+json": {"schema": {"$ref": REF.format(model="ProblemDetails")}}}}
    if status == 503:
        out["headers"] = {"Retry-After": {"description": "Seconds to wait before trying again.",
                                          "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return out


def build_spec(app: Flask) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``app``, under its settings (``open_reads`` and ``public_metrics`` decide
    which operations need a token, and so which can answer 401 and 403)."""
    views = app.view_functions
    settings: Settings = app.extensions["compilesvc"].settings
    operations: list[tuple[str, str, Op, list[dict[str, Any]]]] = []
    models: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {(ProblemDetails, "serialization"): None}
    for rule in app.url_map.iter_rules():
        op: Op | None = getattr(views.get(rule.endpoint), "_openapi", None)
        if op is None:
            continue
        path, path_params = openapi_path(rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            operations.append((path, method.lower(), op, path_params))
        if op.request is not None:
            models[(op.request, "validation")] = None
        for response in op.responses.values():
            if isinstance(response, type):
                models[(response, "serialization")] = None
    refs, top = models_json_schema(list(models), ref_template=REF)

    paths: dict[str, dict[str, Any]] = {}
    param_defs: dict[str, Any] = {}
    for path, method, op, path_params in sorted(operations, key=lambda o: (o[0], o[1])):
        item: dict[str, Any] = {"summary": op.summary, "description": op.description, "tags": [op.tag],
                                "operationId": f"{method}_{re.sub(r'[^a-zA-Z0-9]+', '_', path).strip('_')}"}
        params = list(path_params)
        if op.query is not None:
            params += _model_params(op.query, "query", param_defs)
        if op.headers is not None:
            params += _model_params(op.headers, "header", param_defs)
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
            elif isinstance(response, tuple):
                entry["content"] = {response[0]: {"schema": response[1]}}
            elif response is not None:
                entry["content"] = {response: {"schema": {"type": "string"}}}
            if status in op.response_headers:
                entry["headers"] = {name: {"description": text, "schema": {"type": "string"}}
                                    for name, text in op.response_headers[status].items()}
            responses[str(status)] = entry
        # Every parameter is read by its model: anything with parameters can be a 400 (or the endpoint's own).
        declared = {PROBLEM_TYPES[op.invalid_query].status} if op.query or op.headers else set()
        item["security"] = _security(op, settings)
        token_checked = checks_sent_token(op.access or Permission.ADMIN, settings)
        if token_checked:
            declared |= {401} if {} in item["security"] else {401, 403}
        if token_checked or op.access == SIGNED_URL:
            # The token check reads the ledger and a signed URL's blob is in the store: either can be away,
            # which is a 503 (ledger-unavailable, store-unavailable) with Retry-After, as 500 is everywhere.
            declared.add(503)
        if op.request is not None or (method == "post" and op.request_schema is None):
            declared.add(415)  # a body must be JSON (web.auth)
        for status in sorted({*op.problems, *declared, 500}):
            responses[str(status)] = _problem_ref(status)
        item["responses"] = responses
        paths.setdefault(path, {})[method] = item

    components = dict(top.get("$defs", {}))
    seen: set[str] = set()
    for (model, mode) in models:
        if mode == "validation":  # request bodies: the JSON reader refuses NUL anywhere in them
            _no_nul(refs[(model, mode)], components, seen)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "compilesvc",
            "version": __version__,
            "description": "Compile-artifact service for AWS Neuron (inf2/trn) and CPU targets. Errors are "
                           "RFC 9457 problem details (application/problem+json).",
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        # Where clients reach this deployment (COMPILESVC_PUBLIC_URL): the paths below are relative to it.
        "servers": [{"url": settings.public_url.rstrip("/") or "/",
                     "description": "This deployment (COMPILESVC_PUBLIC_URL)"}],
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()
                 if any(item.get("tags") == [name] for ops in paths.values() for item in ops.values())],
        "paths": paths,
        "components": {"schemas": {**param_defs, **components}, "securitySchemes": SECURITY_SCHEMES},
    }


SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "An API token (`compilesvc tokens create`); the scopes each operation needs are "
                              "in docs/security.md."},
    "session": {"type": "apiKey", "in": "cookie", "name": "compilesvc_session",
                "description": "The web UI's login session; changes also need the X-CSRF-Token header."},
}


def _security(op: Op, settings: Settings) -> list[dict[str, list[str]]]:
    """Who may call, under this deployment's settings (:func:`web.contract.access.needed`, which the server enforces):
    no one needs a token for public operations and signed URLs; what ``open_reads`` opens and a public
    /metrics take one optionally (``{}``: none at all); the rest need one."""
    if op.access in (PUBLIC, SIGNED_URL):
        return []
    required: list[dict[str, list[str]]] = [{"bearer": []}] if op.access == METRICS else \
        [{"bearer": []}, {"session": []}]
    return required if needed(op.access or Permission.ADMIN, settings) is not None else [{}, *required]


def _describe_status(status: int, response: type[BaseModel] | str | tuple[str, dict[str, Any]] | None) -> str:
    text = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 304: "Not Modified"}.get(status, str(status))
    if response is None:
        return text
    name = response.__name__ if isinstance(response, type) else response[0] if isinstance(response, tuple) else response
    return f"{text} ({name})"
