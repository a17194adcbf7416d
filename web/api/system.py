"""Operational endpoints: liveness, readiness, metrics, the worker registry, and the API description.

``/healthz`` is static (it answers while the process can answer at all); ``/readyz`` checks what every
request needs: the ledger (``SELECT 1``). The broker and the store are not readiness: lookups need neither,
and a Redis or S3 blip must not take every API pod out of its Service at once; their health is exported as
metrics (``web.server.dependency_health``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, redirect, render_template
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select, text
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as WerkzeugResponse

from compilesvc.access.tokens import Permission
from compilesvc.dispatch.registry import live_workers, queue_depths
from compilesvc.ledger.models import Worker
from web.api.params import json_response, respond
from web.context import WebContext, web
from web.contract.access import METRICS, PUBLIC, access
from web.contract.inputs import WorkersQuery
from web.contract.openapi import build_spec, operation
from web.contract.problems import PROBLEM_TYPES, Problem
from web.contract.schemas import HealthOut, ReadyOut, WorkersOut

log = logging.getLogger(__name__)
bp = Blueprint("system", __name__)

_HEALTH_BODY = b'{"status":"ok"}'


@bp.get("/healthz")
@operation(summary="Liveness (static)", tag="system", responses={200: HealthOut}, access=PUBLIC,
           description="200 whenever the process serves HTTP; it checks nothing else (`/readyz` does). For a "
                       "liveness probe.")
def healthz() -> Response:
    return Response(_HEALTH_BODY, mimetype="application/json")


def _check_db(ctx: WebContext) -> None:
    with ctx.services.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


@bp.get("/readyz")
@operation(summary="Readiness: the ledger reachable", tag="system", access=PUBLIC,
           description="Checks the ledger, which every request needs; 503 when it is unreachable, so a load "
                       "balancer stops sending requests to this process. The broker and the store are not "
                       "checked here (a blip of either must not take every API process out of service): their "
                       "health is `compilesvc_dependency_up` on `/metrics`.",
           responses={200: ReadyOut}, problems=(503,))
def readyz() -> Response:
    ctx = web()
    checks: dict[str, str] = {}
    failed: list[str] = []
    probes: dict[str, Callable[[WebContext], None]] = {"database": _check_db}
    for name, probe in probes.items():
        started = time.perf_counter()
        try:
            probe(ctx)
        except Exception as exc:  # every failure mode of a dependency is "not ready", never a 500
            checks[name] = f"failed: {type(exc).__name__}: {exc}"[:500]
            failed.append(name)
            log.warning("readiness check failed", extra={"check": name, "error": checks[name]})
        else:
            checks[name] = f"ok ({(time.perf_counter() - started) * 1000:.1f} ms)"
    if failed:
        raise Problem("not-ready", f"not ready: {', '.join(failed)} failed", checks=checks, failed=failed,
                      headers={"Retry-After": "5"})
    return respond(ReadyOut, {"status": "ready", "checks": checks})


@bp.get("/metrics")
@operation(summary="Prometheus metrics", tag="system", responses={200: CONTENT_TYPE_LATEST.split(";")[0]},
           access=METRICS,
           description="This API process's metrics in the Prometheus text format. Needs no token unless "
                       "`COMPILESVC_PUBLIC_METRICS` is false (then a read token).")
def metrics() -> Response:
    return Response(generate_latest(web().metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


@bp.get("/v1/workers")
@operation(summary="Workers and queues", tag="system", query=WorkersQuery, responses={200: WorkersOut},
           access=Permission.READ,
           description="The registered workers (live ones, with a recent heartbeat, unless `all`), what each can "
                       "compile and runs now, and each queue's depth, naming the queues no live worker serves.")
def workers(query: WorkersQuery) -> Response:
    ctx = web()
    include_all = query.all
    stale = ctx.settings.worker_stale_seconds
    with ctx.services.sessions() as session:
        live = live_workers(session, stale)
        live_ids = {w.id for w in live}
        shown = list(session.scalars(select(Worker).order_by(Worker.id))) if include_all else live
        depths = queue_depths(session, live)
    queues = [{"name": q.name, "live_workers": q.live_workers, "queued": q.queued, "running": q.running}
              for q in depths]
    body = {
        "workers": [{
            "id": w.id, "hostname": w.hostname, "capabilities": w.capabilities, "queues": w.queues,
            "slots": w.slots, "started_at": w.started_at.isoformat(), "heartbeat_at": w.heartbeat_at.isoformat(),
            "draining_at": w.draining_at.isoformat() if w.draining_at else None,
            "stopped_at": w.stopped_at.isoformat() if w.stopped_at else None, "live": w.id in live_ids,
        } for w in shown],
        "queues": queues,
    }
    return respond(WorkersOut, body)


def openapi_document() -> dict[str, Any]:
    ctx = web()
    if ctx.openapi is None:  # routes do not change after startup: build once
        ctx.openapi = build_spec(current_app)
    return ctx.openapi


@bp.get("/openapi.json")
@access(PUBLIC)
def openapi_json() -> Response:
    return json_response(openapi_document())


@bp.get("/docs")
@access(PUBLIC)
def docs() -> str:
    return render_template("docs.html", spec=openapi_document(), problems=PROBLEM_TYPES.values())


@bp.get("/problems/<code>")
@access(PUBLIC)
def problem_type(code: str) -> WerkzeugResponse:
    if code not in PROBLEM_TYPES:
        raise NotFound()
    return redirect(f"/docs#problem-{code}", 303)
