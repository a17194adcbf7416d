"""Who is asking, and may they: authentication, each endpoint's access, CSRF, and the JSON-only rule.

Every view declares its access (:mod:`web.contract.access`): :func:`web.contract.openapi.operation`'s ``access=``
for API endpoints, and :func:`web.contract.access.access` for the rest. One ``before_request`` hook
(:func:`install`) enforces it before any view code runs, in this order:

1. **Access.** A :class:`compilesvc.access.tokens.Permission`, or one of ``PUBLIC``, ``SIGNED_URL`` (the
   URL's signature is the credential), ``METRICS`` (public unless ``public_metrics`` is off). A view
   that declares nothing needs ``admin``: forgetting a declaration closes an endpoint, never opens it.
   ``open_reads`` opens the read and artifact permissions to requests without a token; a token sent to
   them anyway must be valid (401 otherwise).
2. **The token.** ``Authorization: Bearer <token>``, or a UI session cookie made by the login page (a
   signed cookie carrying a server-side session's secret, :mod:`compilesvc.access.ui_sessions`: logout ends the
   session for every copy of the cookie, and the token is re-checked, so revoking it ends them too). No token:
   401; a token that is unknown, expired or revoked: 401 with the same words (an answer never tells which
   tokens exist); a token without the permission: 403 naming the scope it needs. A checked token is
   trusted for ``token_cache_seconds`` per process (the fleet's lookups pay no ledger query).
3. **Cross-site requests.** A request authenticated by the cookie that changes something (POST …) must
   carry the session's CSRF token (``X-CSRF-Token``, or the ``csrf_token`` form field of the UI's forms)
   and, if it has an ``Origin``, come from this site. Bearer tokens are never sent by a browser on its own.
4. **JSON only.** An API request with a body must say ``application/json`` (415 otherwise; model uploads
   take the raw file), so a cross-site form or ``text/plain`` fetch can never act.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Request, current_app, g, redirect, request, session, url_for
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface
from werkzeug.wrappers import Response as WerkzeugResponse

from compilesvc.access import tokens, ui_sessions
from compilesvc.access.tokens import Permission, Principal
from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.services import Services
from web.context import LRU, web
from web.contract.access import checks_sent_token, declared_access, needed
from web.contract.problems import Problem

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_TYPES = ("application/json",)
SESSION_LIFETIME = ui_sessions.LIFETIME
UPLOAD_ENDPOINT = "blobs.upload_model"
INVALID_TOKEN = "the token is not valid (unknown, expired or revoked)"


class TokenCache:
    """Principals this process has checked, trusted for ``ttl`` seconds: by token hash (bearer) or by token
    id (UI sessions). Bounded, so a flood of distinct tokens costs memory no more than an LRU's worth."""

    def __init__(self, services: Services, ttl: float, maxsize: int = 4096):
        self.services = services
        self.ttl = ttl
        self._entries: LRU[str, tuple[Principal, float]] = LRU(maxsize)

    def _cached(self, key: str) -> Principal | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] < time.monotonic():
            return None
        principal = entry[0]
        if principal.expires_at is not None and principal.expires_at.timestamp() <= time.time():
            return None
        return principal

    def _remember(self, key: str, principal: Principal | None) -> Principal | None:
        if principal is not None and self.ttl > 0:
            self._entries.put(key, (principal, time.monotonic() + self.ttl))
        return principal

    def by_secret(self, secret: str) -> Principal | None:
        if not tokens.looks_like_token(secret):
            return None
        key = "h:" + tokens.token_hash(secret)
        cached = self._cached(key)
        if cached is not None:
            return cached
        with self.services.sessions() as db:
            principal = tokens.authenticate(db, secret)
        if principal is not None:  # a checked token's use is recorded once per cache period at most
            with transaction(self.services.sessions) as db:
                tokens.record_use(db, principal.token_id)
        return self._remember(key, principal)

    def by_session(self, secret: str) -> Principal | None:
        """The principal of a live UI session: the session row is trusted for ``ttl`` like a token, and its
        token is then checked as :meth:`by_id` checks it (so a revocation here ends it here at once)."""
        key = "s:" + ui_sessions.session_hash(secret)
        cached = self._cached(key)
        if cached is not None:
            return self.by_id(cached.token_id)
        with self.services.sessions() as db:
            found = ui_sessions.live_token_id(db, secret)
        return self._remember(key, self.by_id(found)) if found is not None else None

    def forget_session(self, secret: str) -> None:
        """Stop trusting a session this process ended (logout)."""
        self._entries.drop("s:" + ui_sessions.session_hash(secret))

    def by_id(self, token_id: int) -> Principal | None:
        key = f"i:{token_id}"
        cached = self._cached(key)
        if cached is not None:
            return cached
        with self.services.sessions() as db:
            return self._remember(key, tokens.active_principal(db, token_id))

    def forget(self, principal: Principal, token_hash: str) -> None:
        """Stop trusting a token this process revoked (other processes trust it for at most ``ttl`` more
        seconds)."""
        for key in (f"i:{principal.token_id}", f"h:{token_hash}"):
            self._entries.put(key, (principal, 0.0))


def unauthorized(detail: str, *, invalid: bool = False, scope: str | None = None) -> Problem:
    challenge = 'Bearer realm="compilesvc"' + (', error="invalid_token"' if invalid else "")
    extra: dict[str, Any] = {"required_scope": scope} if scope else {}
    return Problem("unauthorized", detail, headers={"WWW-Authenticate": challenge}, **extra)


def forbidden(principal: Principal, permission: Permission) -> Problem:
    scopes = ", ".join(sorted(principal.scopes))
    return Problem("forbidden", f"this needs a token with the {scope_for(permission)} scope; this token has "
                                f"{scopes}", required_scope=scope_for(permission),
                   headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{scope_for(permission)}"'})


def scope_for(permission: Permission) -> str:
    """The least scope that grants ``permission`` (fleet for the artifact lookups)."""
    return {Permission.ARTIFACTS: "fleet"}.get(permission, permission.value)


def current_principal() -> Principal | None:
    """The request's principal (bearer token, else UI session), found once per request."""
    if "principal" not in g:
        g.principal, g.by_cookie = _identify()
    principal: Principal | None = g.principal
    return principal


def signed_in() -> Principal | None:
    """For pages that show who is logged in: the principal, or None (also for a token that is not valid,
    which only the pages that need one refuse)."""
    try:
        return current_principal()
    except Problem:
        return None


def _identify() -> tuple[Principal | None, bool]:
    cache = web().tokens
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise unauthorized("send the token as 'Authorization: Bearer <token>'", invalid=True)
        principal = cache.by_secret(secret.strip())
        if principal is None:
            raise unauthorized(INVALID_TOKEN, invalid=True)
        return principal, False
    sid = session.get("sid")
    if isinstance(sid, str):
        principal = cache.by_session(sid)
        if principal is None:
            session.clear()  # logged out, expired, or its token revoked or expired
        return principal, principal is not None
    if "tid" in session:
        session.clear()  # a cookie from before server-side sessions (it named its token): log in again
    return None, False


def csrf_token() -> str:
    """The UI session's CSRF token (made on first use); forms put it in ``csrf_token``."""
    token = session.get("csrf")
    if not isinstance(token, str):
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


def check_csrf() -> None:
    """Refuse a cookie-authenticated change that did not come from one of our pages."""
    origin = request.headers.get("Origin")
    if origin is not None and not _same_origin(origin):  # "null" (an opaque origin) is never ours
        raise Problem("csrf-failed", f"a cross-site request (Origin {origin}) cannot use the session")
    expected = session.get("csrf")
    sent = request.headers.get("X-CSRF-Token")
    if sent is None and request.mimetype == "application/x-www-form-urlencoded":
        sent = request.form.get("csrf_token")
    if not isinstance(expected, str) or sent is None or not hmac.compare_digest(sent, expected):
        raise Problem("csrf-failed", "the form is missing its CSRF token or it does not match this session; "
                                     "reload the page and try again")


def _same_origin(origin: str) -> bool:
    ours = {request.host_url.rstrip("/"), web().public_url}
    parts = urlsplit(origin)
    return f"{parts.scheme}://{parts.netloc}" in {o.rstrip("/") for o in ours}


def _require_json(view: Callable[..., Any] | None) -> None:
    if request.method in SAFE_METHODS or request.endpoint == UPLOAD_ENDPOINT or not request.path.startswith("/v1/"):
        return
    op = getattr(view, "_openapi", None)
    has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    takes_json = op is not None and op.request is not None
    if not (takes_json or has_body):
        return
    mimetype = request.mimetype
    if mimetype in JSON_TYPES or mimetype.endswith("+json"):
        return
    said = f"Content-Type {mimetype}" if mimetype else "no Content-Type"
    raise Problem("json-required", f"the request body must be JSON, sent as application/json (it has {said})",
                  headers={"Accept-Post": "application/json"} if request.method == "POST" else None)


def _authorize() -> WerkzeugResponse | None:
    endpoint = request.endpoint
    if endpoint is None:  # no route: the 404 or 405 answers
        return None
    view = current_app.view_functions.get(endpoint)
    level = declared_access(endpoint, view)
    settings = web().settings
    permission = needed(level, settings)
    if permission is None and "Authorization" in request.headers and checks_sent_token(level, settings):
        current_principal()  # an open read: the token is optional, but one that is sent must be valid
    elif permission is not None:
        principal = current_principal()
        if principal is None:
            if request.blueprint == "ui" and request.method == "GET":
                return redirect(url_for("ui.login", next=request.full_path.rstrip("?")), 303)
            raise unauthorized(f"this needs a token with the {scope_for(permission)} scope: send "
                               "'Authorization: Bearer <token>'", scope=scope_for(permission))
        if not principal.allows(permission):
            raise forbidden(principal, permission)
        if g.by_cookie and request.method not in SAFE_METHODS:
            check_csrf()
    _require_json(view)
    return None


def start_session(principal: Principal) -> None:
    """Log the browser in as ``principal`` (the UI's login form, once the token is checked): a new
    server-side session (:mod:`compilesvc.access.ui_sessions`) whose secret the signed cookie carries."""
    with transaction(web().services.sessions) as db:
        secret = ui_sessions.start(db, principal.token_id, SESSION_LIFETIME)
    session.clear()
    session.permanent = True
    session["sid"] = secret
    csrf_token()


def end_session() -> None:
    """Log the browser out: its server-side session ends, for every copy of the cookie, at once in this
    process (other API processes trust a checked session for ``token_cache_seconds`` at most)."""
    secret = session.get("sid")
    if isinstance(secret, str):
        with transaction(web().services.sessions) as db:
            ui_sessions.end(db, secret)
        web().tokens.forget_session(secret)
    session.clear()


class _CookieSessions(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions, opened only for a request that has the cookie: an API client never
    sends one, and Flask built a signing serializer for every request to find that out."""

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if self.get_cookie_name(app) not in request.cookies:
            return self.session_class()
        return super().open_session(app, request)


def install(app: Flask, settings: Settings) -> None:
    """Session cookies for the UI, the bootstrap token, and the hook that enforces every view's access."""
    app.secret_key = settings.resolved_secret_key
    app.config.update(
        SESSION_COOKIE_NAME="compilesvc_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=settings.public_url.startswith("https://"),
        PERMANENT_SESSION_LIFETIME=SESSION_LIFETIME,
    )
    app.session_interface = _CookieSessions()
    app.jinja_env.globals["csrf_token"] = csrf_token
    app.jinja_env.globals["signed_in"] = signed_in
    app.before_request(_authorize)
