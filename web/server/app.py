"""The Flask application factory: ``create_app(settings=None, services=None)``.

One blueprint per resource (builds, artifacts, blobs/models, system, UI). Cross-cutting behaviour lives
here: the request-size limit (413 problem before a view runs), problem+json error handlers, and one
structured log line per request (method, path, status, duration_ms, and build_id / artifact_key when a
view learned them) through :mod:`compilesvc.jsonlog`'s formatter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

from flask import Flask, Response, g, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.routing import BaseConverter, ValidationError

from compilesvc import states
from compilesvc.access import tokens
from compilesvc.builds.submit import Submitter
from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.lifecycle.fetch_stats import DEFAULT_INTERVAL_SECONDS, FetchRecorder
from compilesvc.services import Services
from web import auth, ui
from web.api import (
    artifacts,
    blobs,
    builds,
    campaigns,
    logs,
    pins,
    rollforward_policies,
    subscriptions,
    system,
    webhooks,
)
from web.api import tokens as tokens_api
from web.api.params import too_large
from web.context import (
    DEFAULT_ABSENT_SECONDS,
    DEFAULT_MANIFEST_CACHE_SIZE,
    DEFAULT_PREPARED_CACHE_SIZE,
    LRU,
    ManifestCache,
    WebContext,
)
from web.contract import problems
from web.contract.inputs import MAX_ID, has_nul_in_query
from web.server import ratelimit, security_headers
from web.server.dependency_health import DependencyCollector, broker_check, store_check
from web.server.metrics import ApiMetrics, LedgerCollector, make_registry

access_log = logging.getLogger("compilesvc.web.access")


class LedgerIdConverter(BaseConverter):
    """A positive 64-bit row id (builds, tokens, campaigns); anything else is no route (404), never a
    database overflow."""

    regex = r"[0-9]{1,19}"

    def to_python(self, value: str) -> int:
        number = int(value)
        if not 0 < number <= MAX_ID:
            raise ValidationError()
        return number

    def to_url(self, value: Any) -> str:
        return str(int(value))


class Sha256Converter(BaseConverter):
    regex = r"[0-9a-f]{64}"


class JSONProvider(DefaultJSONProvider):
    """Compact, unsorted JSON with ISO 8601 datetimes (Flask's default writes HTTP dates)."""

    sort_keys = False
    compact = True
    ensure_ascii = False

    @staticmethod
    def default(o: Any) -> Any:
        if isinstance(o, (datetime, date)):
            return o.isoformat()
        return DefaultJSONProvider.default(o)


def create_app(settings: Settings | None = None, services: Services | None = None,
               config: Mapping[str, Any] | None = None) -> Flask:
    """Build the app. ``services`` (if given) is used as is and stays the caller's to close; otherwise
    one is built from ``settings`` (default: ``Settings()`` from the environment)."""
    if services is None:
        services = Services.from_settings(settings)
    settings = services.settings
    _ = services.signer  # a signing key that cannot be used stops the start, not the first publish

    app = Flask("web")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_request_bytes,
        SSE_POLL_SECONDS=0.5,        # how often a live log stream polls the ledger
        SSE_MAX_SECONDS=300.0,       # lifetime of one stream; EventSource reconnects with Last-Event-ID
        SSE_HEARTBEAT_SECONDS=15.0,  # comment frames keep idle streams open through proxies
        SSE_MAX_STREAMS=4,           # per process: each open stream holds a server thread
        MANIFEST_CACHE_SIZE=DEFAULT_MANIFEST_CACHE_SIZE,
        ABSENT_ARTIFACT_SECONDS=DEFAULT_ABSENT_SECONDS,  # a key in neither ledger nor store: 404 from memory
        PREPARED_CACHE_SIZE=DEFAULT_PREPARED_CACHE_SIZE,
        METRICS_CACHE_SECONDS=5.0,   # ledger metrics are re-read at most this often
        FETCH_FLUSH_SECONDS=DEFAULT_INTERVAL_SECONDS,  # artifact lookups are written this often, in one batch
        UI_PAGE_SIZE=50,
    )
    app.config.update(config or {})
    app.json = JSONProvider(app)
    app.url_map.converters["ledger_id"] = LedgerIdConverter
    app.url_map.converters["sha256"] = Sha256Converter
    app.jinja_env.globals["states"] = states  # templates compare states by name, never by spelling

    registry = make_registry()
    registry.register(LedgerCollector(services.sessions, settings.worker_stale_seconds,
                                      cache_seconds=float(app.config["METRICS_CACHE_SECONDS"])))
    registry.register(DependencyCollector({"broker": broker_check(services), "store": store_check(services)},
                                          cache_seconds=float(app.config["METRICS_CACHE_SECONDS"])))
    cache = ManifestCache(services.store, int(app.config["MANIFEST_CACHE_SIZE"]),
                          float(app.config["ABSENT_ARTIFACT_SECONDS"]))
    app.extensions["compilesvc"] = WebContext(
        services=services, submitter=Submitter(services, manifests=cache), manifests=cache,
        prepared=LRU(int(app.config["PREPARED_CACHE_SIZE"])),
        metrics=ApiMetrics(registry), public_url=settings.public_url.rstrip("/"),
        streams=threading.BoundedSemaphore(int(app.config["SSE_MAX_STREAMS"])),
        tokens=auth.TokenCache(services, settings.token_cache_seconds),
        submit_limiter=ratelimit.SubmitLimiter(settings),
        fetches=FetchRecorder(services.sessions, float(app.config["FETCH_FLUSH_SECONDS"])),
    )
    if settings.bootstrap_token is not None:
        _register_bootstrap_token(services, settings.bootstrap_token.get_secret_value())

    problems.install(app)
    _install_request_hooks(app)
    security_headers.install(app)
    auth.install(app, settings)  # after the timing and size hooks: refusals are logged with their duration

    for blueprint in (builds.bp, logs.bp, webhooks.bp, artifacts.bp, blobs.bp, campaigns.bp, rollforward_policies.bp,
                      pins.bp, subscriptions.bp, tokens_api.bp, system.bp, ui.bp):
        app.register_blueprint(blueprint)
    return app


def _register_bootstrap_token(services: Services, secret: str) -> None:
    try:
        with transaction(services.sessions) as session:
            tokens.ensure_token(session, secret, name="bootstrap", owner="bootstrap", scopes=["admin"])
    except tokens.TokenError as exc:
        raise ValueError(f"COMPILESVC_BOOTSTRAP_TOKEN: {exc}") from None


def _install_request_hooks(app: Flask) -> None:
    @app.before_request
    def _begin() -> None:
        g.started = time.perf_counter()
        # The general body limit, checked up front so that it holds for every endpoint, including
        # those that never read a body. Uploads have their own (larger) limit.
        length = request.content_length
        if length is not None and length > app.config["MAX_CONTENT_LENGTH"] and (
            request.endpoint != blobs.UPLOAD_ENDPOINT
        ):
            raise too_large(app.config["MAX_CONTENT_LENGTH"])
        # API views read their query through their declared models (web.contract.inputs), which refuse NUL
        # themselves; the UI's pages read theirs directly.
        if request.blueprint == "ui" and has_nul_in_query():
            raise problems.Problem("invalid-request", "query parameters must not contain NUL characters",
                                   errors=[{"field": "query", "message": "contains NUL"}])

    @app.after_request
    def _log_request(response: Response) -> Response:
        started = g.get("started")
        duration_ms = round((time.perf_counter() - started) * 1000, 2) if started is not None else None
        extra: dict[str, Any] = {"method": request.method, "path": request.path, "status": response.status_code,
                                 "duration_ms": duration_ms, "client": request.remote_addr}
        for name in ("build_id", "artifact_key"):
            value = g.get(name)
            if value is not None:
                extra[name] = value
        access_log.info("%s %s %s", request.method, request.path, response.status_code, extra=extra)
        return response
