"""Signing in and out: a token pasted into the login form becomes a session cookie (:mod:`web.auth` makes
and re-checks it); login itself is CSRF-protected, and ``next`` is never an open redirect."""

from __future__ import annotations

from urllib.parse import urlsplit

from flask import redirect, render_template, request, session, url_for
from werkzeug.wrappers import Response as WerkzeugResponse

from compilesvc.access.tokens import Permission
from web import auth
from web.context import web
from web.contract.access import PUBLIC, access
from web.ui import bp


def _local_path(target: str | None) -> str:
    """Where to go after logging in: a path on this site only (never an open redirect). Browsers drop tabs
    and newlines from URLs and read a backslash as a slash, so ``/\t/evil.example`` would leave the site:
    no control character, space or backslash is accepted, and what remains must parse as a bare path."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return url_for("ui.history")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F or c == "\\" for c in target):
        return url_for("ui.history")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return url_for("ui.history")
    return target


@bp.route("/login", methods=["GET", "POST"])
@access(PUBLIC)
def login() -> WerkzeugResponse | tuple[str, int]:
    next_path = _local_path(request.values.get("next"))
    if request.method == "GET":
        return render_template("login.html", next=next_path, error=None), 200
    auth.check_csrf()  # login CSRF: a foreign page must not log the browser in as someone else
    principal = web().tokens.by_secret(request.form.get("token", "").strip())
    if principal is None:
        return render_template("login.html", next=next_path, error=auth.INVALID_TOKEN), 401
    if not principal.allows(Permission.READ):
        return render_template("login.html", next=next_path,
                               error="this token cannot browse builds (it needs the read scope)"), 403
    auth.start_session(principal)
    return redirect(next_path, 303)


@bp.post("/logout")
@access(PUBLIC)
def logout() -> WerkzeugResponse:
    if session.get("sid") is not None:
        auth.check_csrf()
    auth.end_session()
    return redirect(url_for("ui.login"), 303)
