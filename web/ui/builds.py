"""Build pages: the history (filters, keyset pages, live rows) and one build (provenance, buckets, log,
failure, artifact, the key and why it missed), with the cancel and retry forms."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from flask import current_app, redirect, render_template, request, url_for
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
from web.ui import bp

TARGETS = ("inf2", "trn1", "trn2", "cpu")


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


