"""The per-token submit rate, with Flask-Limiter.

Each token may submit ``submit_rate_limit`` times (e.g. ``120/minute``) in a sliding window; past it, the
submit is answered 429 ``rate-limited`` with ``Retry-After`` before anything is parsed. The counters live
in Redis when the broker is Redis (every API process counts together, under the broker's key prefix), else
in the process (the embedded default). A limiter whose Redis is away lets submits through and says so in
the log: the outbox keeps submits safe through a broker outage, and the limiter must not undo that.
"""

from __future__ import annotations

import logging
import math
import time

from flask import Flask, Response
from flask_limiter import Limiter, RequestLimit

from compilesvc.config import Settings
from web.auth import current_principal
from web.problems import Problem, response_for

log = logging.getLogger(__name__)

SUBMIT_ENDPOINT = "builds.submit"


def _token_key() -> str:
    principal = current_principal()  # submit needs a token: web.auth has refused anyone without one
    return f"token:{principal.token_id}" if principal is not None else "anonymous"


def _refused(limit: RequestLimit) -> Response:
    """The 429 (Flask-Limiter raises it as its RateLimitExceeded with this response)."""
    retry_after = max(1, math.ceil(limit.reset_at - time.time()))
    return response_for(Problem("rate-limited", f"this token may submit {limit.limit}; try again in {retry_after} s",
                                headers={"Retry-After": str(retry_after)}, retry_after=retry_after))


def storage_uri(settings: Settings) -> str:
    broker = settings.resolved_broker_url
    return broker if broker.startswith(("redis://", "rediss://")) else "memory://"


def install(app: Flask, settings: Settings) -> Limiter:
    """Limit the submit view of ``app`` per token (after web.auth has identified the token)."""
    uri = storage_uri(settings)
    # A Redis that hangs must not hang submits: its commands time out like the broker's publishes. Its keys
    # are all under the deployment's prefix (limits' own prefix comes first otherwise).
    options: dict[str, str | int | float] = {} if uri == "memory://" else {
        "socket_timeout": settings.broker_socket_timeout_seconds,
        "key_prefix": f"{settings.broker_key_prefix}compilesvc-limits"}
    limiter = Limiter(
        _token_key, app=app, storage_uri=uri, strategy="sliding-window-counter",
        storage_options=options,  # type: ignore[arg-type]
        swallow_errors=True, headers_enabled=False,
    )
    view = app.view_functions[SUBMIT_ENDPOINT]
    app.view_functions[SUBMIT_ENDPOINT] = limiter.limit(settings.submit_rate_limit, on_breach=_refused)(view)
    return limiter
