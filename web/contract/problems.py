"""RFC 9457 problem details: every error the API answers is ``application/problem+json``.

A view raises :class:`Problem` (or lets a known exception propagate); the handlers installed by
:func:`install` turn it into ``{type, title, status, detail, instance, ...extensions}``. Problem types
are registered in :data:`PROBLEM_TYPES` so the docs page can list them and a type URI
(``/problems/<code>``) leads to its description. Plain HTTP errors (unknown route, wrong method) use
``about:blank`` with the status phrase as title, as the RFC prescribes.

Nothing a client sends may become a 500: unexpected exceptions still answer problem+json (and are
logged with their traceback), but infrastructure failures (ledger or store unreachable) are told apart
as 503s so clients retry them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from flask import Flask, Response, render_template, request
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import ClientDisconnected, HTTPException

from compilesvc.pinning.pins import ModelPinning
from compilesvc.spec.manifest import ManifestMismatch
from compilesvc.store.base import StoreError

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class ProblemType:
    code: str
    status: int
    title: str
    description: str


_TYPES = [
    ProblemType("invalid-json", 400, "Request body is not valid JSON",
                "The body could not be decoded as UTF-8 JSON. `detail` says where parsing stopped."),
    ProblemType("invalid-request", 400, "Invalid request parameter",
                "A query parameter or header is malformed; `errors` lists each as {field, message}."),
    ProblemType("upload-incomplete", 400, "Upload incomplete",
                "The connection ended before the whole body arrived (`received_bytes` of the Content-Length "
                "`expected_bytes`, or a chunked body without its last chunk). Nothing was stored; upload again."),
    ProblemType("digest-mismatch", 400, "Upload does not match its digest",
                "The body's sha256 (`actual_sha256`) differs from the one declared in Content-Digest, Digest "
                "or `?sha256=` (`expected_sha256`). Nothing was stored."),
    ProblemType("invalid-cursor", 400, "Invalid pagination cursor",
                "Pass back the `next_cursor` of a previous page unchanged."),
    ProblemType("spec-invalid", 422, "Compile spec is invalid",
                "The body is JSON but not a valid CompileSpec; `errors` lists {field, message} per problem."),
    ProblemType("model-ref-invalid", 422, "Model reference cannot be used",
                "The spec's model could not be resolved (unknown blob, unreadable object, disallowed scheme)."),
    ProblemType("idempotency-key-reused", 422, "Idempotency-Key reused with a different body",
                "An Idempotency-Key identifies one request body; use a new key for a different spec."),
    ProblemType("unauthorized", 401, "A valid token is needed",
                "Send `Authorization: Bearer <token>`. The same answer is given for a missing, unknown, expired "
                "or revoked token. Tokens are made with `compilesvc tokens create` (docs/security.md)."),
    ProblemType("forbidden", 403, "The token's scopes do not allow this",
                "`required_scope` names the scope this needs (docs/security.md has the matrix)."),
    ProblemType("not-your-build", 403, "The build belongs to another team",
                "Cancel and retry are for the submitting team's tokens (with the submit scope) and admins."),
    ProblemType("csrf-failed", 403, "Cross-site request refused",
                "A change made with the UI's session cookie must come from the UI's own page, with its CSRF "
                "token. API clients send a bearer token instead."),
    ProblemType("token-not-found", 404, "Token not found", "No token has this id."),
    ProblemType("token-invalid", 422, "Token cannot be made as asked",
                "`detail` says which field is wrong (name, owner, team, scopes, expiry)."),
    ProblemType("campaign-invalid", 422, "Campaign cannot be started as asked",
                "`detail` says which field is wrong (e.g. the same release twice, or a release number that "
                "is not one)."),
    ProblemType("campaign-not-found", 404, "Campaign not found", "No campaign has this id."),
    ProblemType("policy-invalid", 422, "Roll-forward policy is invalid",
                "`errors` lists each bad field as {field, message}; nothing was stored."),
    ProblemType("policy-exists", 409, "Roll-forward policy exists", "A policy has this name already."),
    ProblemType("policy-not-found", 404, "Roll-forward policy not found", "No policy has this id or name."),
    ProblemType("pin-invalid", 422, "Pin cannot be made as asked",
                "An artifact pin's value is a key (64 hex digits); a label pin's is `name:value`."),
    ProblemType("pin-not-found", 404, "Pin not found", "No pin has this id."),
    ProblemType("subscription-invalid", 422, "Subscription refused",
                "The URL is not http(s), or resolves to a loopback, link-local, private or reserved address "
                "that the operator did not allow (`COMPILESVC_WEBHOOK_ALLOW_NETWORKS`), or the event is unknown."),
    ProblemType("subscription-not-found", 404, "Subscription not found", "No subscription has this id."),
    ProblemType("json-required", 415, "Request body must be JSON",
                "Requests with a body say `Content-Type: application/json` (model uploads: the raw file, "
                "POST /v1/models). Forms and text/plain are refused, so no other web page can act through "
                "a browser."),
    ProblemType("rate-limited", 429, "Too many submits",
                "This token submitted as often as `COMPILESVC_SUBMIT_RATE_LIMIT` allows; retry after "
                "`Retry-After` seconds."),
    ProblemType("quota-exceeded", 429, "Too many compiles in flight",
                "This token has as many bucket compiles queued or running as `COMPILESVC_MAX_COMPILES_PER_TOKEN` "
                "allows; `in_flight`, `needed` and `limit` say how many. Retry once some finish."),
    ProblemType("spec-over-quota", 422, "The spec needs more compiles than a token may run at once",
                "Split the spec's buckets over several submits, or ask an admin to raise "
                "`COMPILESVC_MAX_COMPILES_PER_TOKEN`."),
    ProblemType("callback-invalid", 422, "Callback URL refused",
                "A `callbacks` URL is not http(s), or resolves to a loopback, link-local, private or reserved "
                "address that the operator did not allow (`COMPILESVC_WEBHOOK_ALLOW_NETWORKS`)."),
    ProblemType("not-cancellable", 409, "Build cannot be cancelled",
                "Only builds that are still building can be cancelled."),
    ProblemType("not-retryable", 409, "Build cannot be retried",
                "Nothing in the build failed, or its artifact is already published."),
    ProblemType("submit-refused", 409, "Submit refused", "The service will not accept this submit as given."),
    ProblemType("build-not-found", 404, "Build not found", "No build has this id."),
    ProblemType("artifact-not-found", 404, "Artifact not found", "No artifact has this key."),
    ProblemType("artifact-not-published", 404, "Artifact not published",
                "The artifact exists but is not published; `state` says what it is doing."),
    ProblemType("artifact-unsigned", 404, "Artifact published without a signature",
                "Published before signing was deployed, or by a deployment with `publish_unsigned`: fleets "
                "refuse it. An administrator signs it after checking its files (`compilesvc sign-artifacts`) or "
                "it is rebuilt. `state` is `published`."),
    ProblemType("blob-not-found", 404, "Blob not found", "The store has no blob with this sha256."),
    ProblemType("signature-invalid", 403, "Download URL invalid or expired",
                "Fetch the artifact again (GET /v1/artifacts/{key}) for fresh download URLs."),
    ProblemType("request-too-large", 413, "Request body too large",
                "Request bodies are limited to `max_bytes`; models are uploaded with POST /v1/models."),
    ProblemType("upload-too-large", 413, "Upload too large", "Model uploads are limited to `max_bytes`."),
    ProblemType("unsupported-media-type", 415, "Upload must be the raw file",
                "POST /v1/models takes the model file itself as the body, as application/octet-stream (or "
                "with no Content-Type), not a form or another type: "
                "`curl --data-binary @model.pt -H 'Content-Type: application/octet-stream'`."),
    ProblemType("no-capable-worker", 503, "No live worker can compile this",
                "No live worker serves the spec's queue. Start one, or submit with ?queue_anyway=true."),
    ProblemType("model-pinning", 503, "The model is being hashed to pin it",
                "The spec's S3 model (or a checkpoint's weight files) is too large to hash inside a request "
                "(COMPILESVC_PIN_INLINE_HASH_MAX_MB) and is being hashed in the background, once however many "
                "submits name it: `detail` says how far (`model`: what is hashed, `bytes_done` of "
                "`bytes_total`). Progress, not an outage: send the same request again after `Retry-After` "
                "seconds (compilesvc submit does)."),
    ProblemType("store-integrity", 503, "Stored manifest does not match its key",
                "The manifest stored for `key` is unreadable or hashes to another key. Nothing is served or "
                "built for that key until an operator removes the document."),
    ProblemType("too-many-streams", 503, "Too many live log streams",
                "This server process streams as many logs as it may; poll GET /v1/builds/{id}/logs or retry later."),
    ProblemType("not-ready", 503, "Service not ready", "`checks` says which dependency failed."),
    ProblemType("store-unavailable", 503, "Artifact store unavailable",
                "The artifact store could not be reached; retry later."),
    ProblemType("ledger-unavailable", 503, "Ledger database unavailable",
                "The ledger database could not be reached; retry later."),
    ProblemType("internal-error", 500, "Internal server error", "A bug: the server log has the traceback."),
]
PROBLEM_TYPES: dict[str, ProblemType] = {t.code: t for t in _TYPES}


def type_uri(code: str) -> str:
    # A relative reference (RFC 9457 allows them): stable whatever host name clients use, and it
    # resolves to this server's /problems/<code>, which leads to the description.
    return f"/problems/{code}"


class Problem(Exception):
    """An error response. ``code`` names a registered problem type; ``extensions`` are extra members."""

    def __init__(self, code: str, detail: str, *, status: int | None = None, headers: dict[str, str] | None = None,
                 **extensions: Any):
        kind = PROBLEM_TYPES[code]
        self.code = code
        self.status = status or kind.status
        self.title = kind.title
        self.detail = detail
        self.headers = headers or {}
        self.extensions = extensions
        super().__init__(detail)


def problem_body(status: int, title: str, detail: str, type_: str = "about:blank",
                 **extensions: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type_, "title": title, "status": status, "detail": detail,
                            "instance": _instance()}
    for key, value in extensions.items():
        body.setdefault(key, value)
    return body


def _instance() -> str:
    try:
        return request.path
    except RuntimeError:  # outside a request (tests building bodies directly)
        return ""


def _wants_html() -> bool:
    """A browser asking for a UI page gets an HTML error page; the API always answers problem+json."""
    if request.path.startswith("/v1/") or request.path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        return False
    best = request.accept_mimetypes.best_match([PROBLEM_JSON, "application/json", "text/html"])
    return best == "text/html"


def problem_response(body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    if _wants_html():
        try:
            html = render_template("error.html", problem=body)
        except Exception:  # a broken error page must not hide the error: fall back to JSON
            log.exception("error page failed to render")
        else:
            response = Response(html, status=body["status"], mimetype="text/html")
            for name, value in (headers or {}).items():
                response.headers[name] = value
            return response
    response = Response(json.dumps(body, ensure_ascii=False, default=str), status=body["status"],
                        mimetype=PROBLEM_JSON)
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def response_for(problem: Problem) -> Response:
    body = problem_body(problem.status, problem.title, problem.detail, type_uri(problem.code),
                        **problem.extensions)
    return problem_response(body, problem.headers)


def _http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    if status == 413:
        limit = request.max_content_length
        detail = f"request bodies are limited to {limit} bytes" if limit else "request body too large"
        return response_for(Problem("request-too-large", detail, max_bytes=limit))
    if isinstance(exc, ClientDisconnected) and isinstance(exc.__context__, TimeoutError):
        # The server's socket timeout ended a body that stopped arriving (web/server/httpworker.py), which
        # werkzeug reports as a disconnect.
        return problem_response(problem_body(408, "Request Timeout",
                                             "the request body stopped arriving; the request was abandoned"),
                                {"Connection": "close"})
    title = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else exc.name
    detail = exc.description or title
    if status == 404:
        detail = f"no resource at {request.path}"
    elif status == 405:
        detail = f"{request.method} is not allowed on {request.path}"
    headers = {}
    for name, value in exc.get_headers():
        if name.lower() in ("allow", "retry-after", "www-authenticate"):
            headers[name] = value
    return problem_response(problem_body(status, title, detail), headers)


def _store_error(exc: StoreError) -> Response:
    log.warning("store error", extra={"error": f"{type(exc).__name__}: {exc}"})
    return response_for(Problem("store-unavailable", str(exc), headers={"Retry-After": "5"}))


def _model_pinning(exc: ModelPinning) -> Response:
    return response_for(Problem("model-pinning", str(exc), headers={"Retry-After": str(exc.retry_after)},
                                model=exc.what, bytes_done=exc.done, bytes_total=exc.total))


def _manifest_mismatch(exc: ManifestMismatch) -> Response:
    log.error("stored manifest does not match its key", extra={"artifact_key": exc.key, "error": str(exc)})
    return response_for(Problem("store-integrity", str(exc), key=exc.key))


def _db_error(exc: DBAPIError | PoolTimeout) -> Response:
    # OperationalError (connection refused, lost, locked): infrastructure, retryable. Other DBAPI
    # errors are bugs (a query the database refused) and stay 500s, logged in full.
    if isinstance(exc, (OperationalError, PoolTimeout)) or getattr(exc, "connection_invalidated", False):
        cause = exc.orig if isinstance(exc, DBAPIError) else exc
        log.warning("ledger unavailable", extra={"error": f"{type(exc).__name__}: {cause}"})
        return response_for(Problem("ledger-unavailable", "the ledger database is unavailable",
                                    headers={"Retry-After": "5"}))
    return _internal(exc)


def _internal(exc: Exception) -> Response:
    log.error("unhandled exception", exc_info=exc)
    return response_for(Problem("internal-error", "the server failed to handle this request"))


def install(app: Flask) -> None:
    """Register the problem handlers on ``app``."""
    app.register_error_handler(Problem, response_for)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(StoreError, _store_error)
    app.register_error_handler(ManifestMismatch, _manifest_mismatch)
    app.register_error_handler(ModelPinning, _model_pinning)
    app.register_error_handler(DBAPIError, _db_error)
    app.register_error_handler(PoolTimeout, _db_error)
    app.register_error_handler(Exception, _internal)
