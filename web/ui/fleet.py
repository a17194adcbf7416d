"""The fleet's pages: artifacts (what exists, by model, how much it is used, what is pinned) and workers
(who can compile what, their heartbeats, what each runs now, the queues and any no live worker serves)."""

from __future__ import annotations

import dataclasses
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from flask import current_app, render_template, request
from pydantic import ValidationError
from sqlalchemy import select

from compilesvc.access.tokens import Permission
from compilesvc.dispatch.registry import live_workers, queue_depths, running_compiles
from compilesvc.insights.artifact_index import ArtifactFilter, ArtifactRow, list_artifacts
from compilesvc.insights.history import MAX_LIMIT
from compilesvc.ledger.models import Worker
from compilesvc.spec.parsing import validation_errors
from compilesvc.states import ArtifactState
from web import readers
from web.context import web
from web.contract.access import access
from web.ui import bp
from web.ui.builds import TARGETS

ARTIFACT_FILTERS = ("model", "target", "sdk", "state")


def _before() -> int | None:
    text = request.args.get("before") or ""
    if not text:
        return None
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 2**63:
        raise ValueError("before: pass back the 'Older' link's value unchanged")
    return int(text)


def _grouped(items: list[ArtifactRow]) -> list[tuple[str, list[ArtifactRow]]]:
    """The page's artifacts by model (name, else sha256), models in the order of their newest artifact."""
    groups: dict[str, list[ArtifactRow]] = {}
    for item in items:
        groups.setdefault(item.model_name or item.model_sha256, []).append(item)
    return list(groups.items())


@bp.get("/artifacts")
@access(Permission.READ)
def artifacts() -> tuple[str, int]:
    ctx = web()
    given = {name: request.args.get(name, "") for name in ARTIFACT_FILTERS}
    error = None
    groups: list[tuple[str, list[ArtifactRow]]] = []
    next_url = None
    try:
        filters = ArtifactFilter(**{k: v for k, v in given.items() if v})
        before = _before()
        with ctx.services.sessions() as session:
            page = list_artifacts(session, filters, limit=min(int(current_app.config["UI_PAGE_SIZE"]), MAX_LIMIT),
                                  before=before, reader=readers.reader())
        groups = _grouped(page.items)
        if page.next_before is not None:
            kept = {k: v for k, v in given.items() if v}
            next_url = "/artifacts?" + urllib.parse.urlencode({**kept, "before": page.next_before})
    except ValidationError as exc:
        error = "; ".join(f"{e['field']}: {e['message']}" for e in validation_errors(exc))
    except ValueError as exc:
        error = str(exc)
    return render_template("artifacts.html", groups=groups, given=given, error=error, next_url=next_url,
                           states=[str(s) for s in ArtifactState], targets=TARGETS,
                           first_url="/artifacts?" + urllib.parse.urlencode({k: v for k, v in given.items() if v})
                           if request.args.get("before") else None), 400 if error else 200


def _heartbeat_age(worker: Worker, now: datetime) -> float:
    return max((now - worker.heartbeat_at).total_seconds(), 0.0)


@bp.get("/workers")
@access(Permission.READ)
def workers() -> str:
    ctx = web()
    stale = ctx.settings.worker_stale_seconds
    now = datetime.now(UTC)
    with ctx.services.sessions() as session:
        live = live_workers(session, stale)
        live_ids = {w.id for w in live}
        # Recently gone workers too: the on-call engineer asks where a worker went.
        everyone = [w for w in session.scalars(select(Worker).order_by(Worker.id))
                    if w.id in live_ids or _heartbeat_age(w, now) < 24 * 3600]
        depths = queue_depths(session, live)
        running = running_compiles(session, readers.reader())
        if readers.reader().bounded:  # a shared compile may have been queued by another team's build
            named = readers.readable_ids(session, [c.build_id for cs in running.values() for c in cs])
            running = {w: [c if c.build_id in named else dataclasses.replace(c, build_id=None) for c in cs]
                       for w, cs in running.items()}
    rows: list[dict[str, Any]] = [{
        "worker": w, "live": w.id in live_ids, "age": _heartbeat_age(w, now), "running": running.get(w.id, []),
        "caps": w.capabilities or {},
    } for w in everyone]
    return render_template("workers.html", rows=rows, queues=depths, stale=stale, now=now,
                           unserved=[q for q in depths if q.unserved])
