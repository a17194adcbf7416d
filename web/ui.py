"""The web UI: server-rendered build history and build detail pages (Jinja, one small CSS file, a few lines
of JS for the live log and the cancel/retry buttons; no external assets).

The pages read through the same code as the JSON API (:func:`compilesvc.history.list_builds`,
:func:`web.api.builds.build_document`), so the UI never shows something the API would not. A browser logs
in by pasting a token (:func:`login`): the session cookie names the token, which is re-checked on every
request (:mod:`web.auth`); forms that change something carry the session's CSRF token.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from datetime import datetime
from typing import Any

from flask import Blueprint, current_app, redirect, render_template, request, session, url_for
from markupsafe import Markup, escape
from pydantic import ValidationError
from werkzeug.wrappers import Response as WerkzeugResponse

from compilesvc.control import cancel_build, retry_build
from compilesvc.history import BUILD_STATES, HistoryFilter, InvalidCursor, count_by_state, list_builds
from compilesvc.services import Services
from compilesvc.spec_parsing import validation_errors
from compilesvc.tokens import Permission, Principal
from web import auth
from web.api.builds import build_document, run_control
from web.api.serialize import summary_json
from web.context import web
from web.inputs import FILTERS

bp = Blueprint("ui", __name__, template_folder="templates", static_folder="static", static_url_path="/static")

TARGETS = ("inf2", "trn1", "trn2", "cpu")


@bp.app_template_filter("when")
def when(value: str | datetime | None) -> str:
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


@bp.app_template_filter("filesize")
def filesize(size: int | None) -> str:
    if size is None:
        return "—"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


@bp.app_template_filter("codespans")
def codespans(text: str | None) -> Markup:
    """Markdown-style `code` spans as <code> (the OpenAPI descriptions use them); everything else escaped."""
    escaped = str(escape(text or ""))
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped))


@bp.app_template_filter("shape")
def shape(inputs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{i.get('name')}: {i.get('dtype')}{list(i.get('shape', []))}" for i in inputs)


@bp.get("/")
@auth.access(Permission.READ)
def history() -> tuple[str, int]:
    ctx = web()
    given = {name: request.args.get(name, "") for name in FILTERS}
    cursor = request.args.get("cursor") or None
    error = None
    items: list[dict[str, Any]] = []
    next_url = None
    counts = {}
    try:
        filters = HistoryFilter(**{k: v for k, v in given.items() if v})
        with ctx.services.sessions() as session:
            page = list_builds(session, filters, limit=int(current_app.config["UI_PAGE_SIZE"]), cursor=cursor)
            items = [summary_json(ctx, build) for build in page.items]
            counts = count_by_state(session)
        if page.next_cursor:
            params = {**{k: v for k, v in given.items() if v}, "cursor": page.next_cursor}
            next_url = "/?" + urllib.parse.urlencode(params)
    except ValidationError as exc:
        error = "; ".join(f"{e['field']}: {e['message']}" for e in validation_errors(exc))
    except InvalidCursor as exc:
        error = str(exc)
    status = 400 if error else 200
    filtered = {k: v for k, v in given.items() if v}
    first_url = ("/?" + urllib.parse.urlencode(filtered)) if cursor is not None else None
    return render_template("history.html", items=items, given=given, next_url=next_url, error=error,
                           counts=counts, states=BUILD_STATES, targets=TARGETS, first_url=first_url), status


@bp.get("/builds/<ledger_id:build_id>")
@auth.access(Permission.READ)
def build_page(build_id: int) -> str:
    build = build_document(web(), build_id)
    # Buckets compile at once and their log lines interleave: each line is labelled with its bucket.
    positions = {bucket["key"]: bucket["position"] for bucket in build["buckets"]}
    return render_template("build.html", build=build, positions=positions)


@bp.post("/builds/<ledger_id:build_id>/cancel")
@auth.access(Permission.SUBMIT)
def cancel_build_form(build_id: int) -> WerkzeugResponse:
    return _control(build_id, cancel_build)


@bp.post("/builds/<ledger_id:build_id>/retry")
@auth.access(Permission.SUBMIT)
def retry_build_form(build_id: int) -> WerkzeugResponse:
    return _control(build_id, retry_build)


def _control(build_id: int, action: Callable[[Services, int, Principal | None], object]) -> WerkzeugResponse:
    """The build page's cancel and retry forms: what the API does, then back to the page."""
    run_control(build_id, action)
    return redirect(url_for("ui.build_page", build_id=build_id), 303)


def _local_path(target: str | None) -> str:
    """Where to go after logging in: a path on this site only (never an open redirect)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return url_for("ui.history")


@bp.route("/login", methods=["GET", "POST"])
@auth.access(auth.PUBLIC)
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
@auth.access(auth.PUBLIC)
def logout() -> WerkzeugResponse:
    if session.get("tid") is not None:
        auth.check_csrf()
    session.clear()
    return redirect(url_for("ui.login"), 303)
