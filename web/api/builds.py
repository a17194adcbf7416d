"""``/v1/builds``: submit a spec, follow a build (its status; its logs are :mod:`web.api.logs`), list history,
cancel, retry.

Submit answers 202 with the build's state and bucket compiles while it builds, or 200 with the artifact
(manifest and fresh download URLs) when the spec is a cache hit, so a CI job can always continue from
one response: poll ``status_url`` on 202, use ``artifact`` on 200.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, g
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import Permission, Principal
from compilesvc.builds import provenance
from compilesvc.builds.admission import QuotaExceeded
from compilesvc.builds.control import BuildNotFound, cancel_build, retry_build
from compilesvc.builds.submit import SubmitResult
from compilesvc.compiles.bucket_compiles import BucketView, bucket_views
from compilesvc.insights import key_diff
from compilesvc.insights.history import BuildDetail, InvalidCursor, InvalidLimit, get_build_detail, list_builds
from compilesvc.ledger.models import Artifact, Build
from compilesvc.notify.webhooks import CallbackRefused
from compilesvc.pinning.pins import ModelRefError
from compilesvc.refusals import NoCapableWorker, SubmitRefused
from compilesvc.services import Services
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.states import ArtifactState, Outcome
from web import readers
from web.api.params import body_text, parse_spec_text, respond
from web.api.serialize import accepted_json, bucket_json, event_json, summary_json
from web.auth import current_principal
from web.context import MAX_PREPARED_BODY, WebContext, web
from web.contract.inputs import (
    FILTERS,
    BuildListQuery,
    SubmitHeaders,
    SubmitQuery,
)
from web.contract.openapi import operation
from web.contract.problems import PROBLEM_TYPES, Problem
from web.contract.schemas import BuildAccepted, BuildList, BuildOut, BuildStateOut, MissOut

log = logging.getLogger(__name__)
bp = Blueprint("builds", __name__, url_prefix="/v1/builds")

def refused(exc: SubmitRefused) -> Problem:
    """A core refusal (its ``status`` and ``code``) as a problem response."""
    code = exc.code if exc.code in PROBLEM_TYPES else "submit-refused"
    extensions: dict[str, Any] = {}
    headers = {}
    if isinstance(exc, NoCapableWorker):
        extensions["queue"] = exc.queue
        headers["Retry-After"] = "30"
    if isinstance(exc, CallbackRefused):
        extensions["errors"] = [{"field": exc.field, "message": exc.reason}]
    if isinstance(exc, QuotaExceeded):
        extensions.update(in_flight=exc.in_flight, needed=exc.needed, limit=exc.limit)
        headers["Retry-After"] = "60"
    return Problem(code, str(exc), status=exc.status, headers=headers, **extensions)


def model_ref_problem(exc: ModelRefError) -> Problem:
    return Problem("model-ref-invalid", str(exc), errors=[{"field": exc.field, "message": exc.message}])


@bp.post("")
@operation(
    summary="Submit a compile spec", tag="builds", request=CompileSpec, access=Permission.SUBMIT,
    description="Deduplicated against everything built or building: a published artifact answers 200 at "
                "once (outcome hit); an artifact in flight is joined (join); otherwise only the bucket "
                "compiles that do not exist yet are queued (new).",
    responses={200: BuildAccepted, 202: BuildAccepted},
    problems=(400, 413, 422, 429, 503), query=SubmitQuery, headers=SubmitHeaders,
    response_headers={202: {"Location": "The build's status URL."}},
)
def submit(query: SubmitQuery, headers: SubmitHeaders) -> Response:
    ctx = web()
    principal = current_principal()
    ctx.submit_limiter.check(principal)  # before the body is read: a refused submit costs next to nothing
    text = body_text()
    prepared = ctx.prepared.get(text)  # the same bytes as a recent submit: parsed, validated, keyed already
    spec = prepared.spec if prepared is not None else parse_spec_text(text)
    ctx.metrics.submits.labels(spec.target, spec.sdk).inc()
    team = principal.team if principal is not None else None  # whose model sources (docs/security.md)
    try:
        if prepared is None:
            prepared = ctx.submitter.prepare(spec, team=team)
            if prepared.reusable and len(text) <= MAX_PREPARED_BODY:
                ctx.prepared.put(text, prepared)
        else:
            prepared = ctx.submitter.checked_for(prepared, team)  # another team's submit may have prepared it
        result = ctx.submitter.submit(prepared, principal=principal,
                                      idempotency_key=headers.idempotency_key, queue_anyway=query.queue_anyway)
    except ModelRefError as exc:
        raise model_ref_problem(exc) from None
    except SubmitRefused as exc:
        raise refused(exc) from None
    g.build_id = result.build_id
    g.artifact_key = result.artifact_key
    if not result.replayed:
        ctx.metrics.outcomes.labels(spec.target, spec.sdk, result.outcome).inc()
    return accepted_response(ctx, result)


def accepted_response(ctx: WebContext, result: SubmitResult) -> Response:
    """200 with the artifact for a hit, 202 with the status URL for a join or a new build (which may be
    published already: a set of buckets other sets compiled is published at once, and says so in the body);
    a replay answers the status its key was first answered with, and the build as it is now (fresh download
    URLs, current state)."""
    headers = {"Idempotent-Replayed": "true"} if result.replayed else {}
    published = result.artifact_state == ArtifactState.PUBLISHED
    status = result.first_status or (200 if result.outcome == Outcome.HIT else 202)
    body = accepted_json(ctx, result)
    if status == 202:
        headers["Location"] = body["status_url"]
    if published:
        # The hit path: the artifact is the manifest cache's JSON, embedded as it is, not decoded again.
        artifact = ctx.describe_json(ctx.published(result.artifact_key))
        return respond(BuildAccepted, body, status, headers, embed={"artifact": artifact})
    return respond(BuildAccepted, body, status, headers)


@bp.get("")
@operation(summary="Build history", tag="builds", query=BuildListQuery, access=Permission.READ,
           description="Newest first, keyset-paginated: follow `next` (or pass `next_cursor` as `cursor`). "
                       "Filters combine with AND.",
           responses={200: BuildList}, problems=(400,), response_headers={200: {"Link": 'rel="next" page URL'}})
def list_history(query: BuildListQuery) -> Response:
    ctx = web()
    try:
        with ctx.services.sessions() as session:
            page = list_builds(session, query, limit=query.limit, cursor=query.cursor, reader=readers.reader())
            items = [summary_json(ctx, build) for build in page.items]
    except InvalidCursor as exc:
        raise Problem("invalid-cursor", str(exc)) from None
    except InvalidLimit as exc:  # pragma: no cover - BuildListQuery bounds the limit first
        raise Problem("invalid-request", str(exc)) from None
    next_url = None
    headers = {}
    if page.next_cursor is not None:
        params: dict[str, Any] = query.model_dump(include={*FILTERS, "limit"}, exclude_unset=True, exclude_none=True)
        params["cursor"] = page.next_cursor
        next_url = ctx.url("/v1/builds?" + urllib.parse.urlencode(params))
        headers["Link"] = f'<{next_url}>; rel="next"'
    return respond(BuildList, {"items": items, "next_cursor": page.next_cursor, "next": next_url}, 200, headers)


def load_build(ctx: WebContext, build_id: int) -> tuple[BuildDetail, list[BucketView]]:
    """The build with its artifact and events, and its bucket compiles with their failures; 404 if none
    (or if the request may not read it: :mod:`web.readers`)."""
    with ctx.services.sessions() as session:
        detail = get_build_detail(session, build_id, reader=readers.reader())
        if detail is None:
            raise readers.no_build(build_id)
        return detail, bucket_views(session, detail.artifact.id)


def document_of(ctx: WebContext, detail: BuildDetail, buckets: list[BucketView]) -> dict[str, Any]:
    """A loaded build (:func:`load_build`) as GET /v1/builds/{id} answers it (the UI renders the same)."""
    build, artifact = detail.build, detail.artifact
    origins = provenance.origins(build, buckets)
    if readers.reader().bounded:
        with ctx.services.sessions() as session:
            origins = readers.redact_origins(session, origins)
    described = None
    if artifact.state == ArtifactState.PUBLISHED:
        described = ctx.describe(ctx.published_manifest(artifact.key))
    return {
        "build_id": build.id, "state": build.state, "outcome": build.outcome, "artifact_key": artifact.key,
        "artifact_state": artifact.state, "submitted_by": build.submitted_by, "labels": build.labels,
        "model_name": build.model_name, "model_sha256": build.model_sha256, "target": build.target,
        "sdk": build.sdk, "backend": build.backend, "created_at": build.created_at.isoformat(),
        "finished_at": build.finished_at.isoformat() if build.finished_at else None, "spec": build.spec,
        "buckets": [bucket_json(view, origins.get(view.compile_id or 0)) for view in buckets],
        "events": [_event_for_reader(event_json(event)) for event in detail.events],
        "status_url": ctx.build_url(build.id), "logs_url": ctx.build_url(build.id, "/logs"),
        "artifact": described,
    }


def _event_for_reader(event: dict[str, Any]) -> dict[str, Any]:
    """An artifact's event as the request may read it: a shared artifact's event details may name another
    team's build ("retry of build 12"), so a bounded reader gets the transition without them."""
    if event["entity"] == "artifact" and readers.reader().bounded:
        return {**event, "detail": {}}
    return event


def miss_document(session: Session, build: Build) -> dict[str, Any]:
    """GET /v1/builds/{id}/miss's body (also rendered by the build page, in the session it reads with),
    compared only with builds the request may read."""
    compared = key_diff.explain_miss(session, build, readers.reader())
    return {
        "build_id": build.id, "outcome": build.outcome,
        "compared_with": None if compared is None else {
            "artifact_key": compared.artifact_key, "artifact_state": compared.artifact_state,
            "build_id": compared.build_id, "sdk": compared.sdk},
        "changes": [] if compared is None else [{"component": c.component, "text": c.text}
                                                for c in compared.changes],
    }


@bp.get("/<ledger_id:build_id>/miss")
@operation(summary="Why a build's key was new: changes since the closest earlier artifact of its model",
           tag="builds", access=Permission.READ, responses={200: MissOut}, problems=(404,),
           description="Compares the build's key material with the closest of the model's 50 most recent "
                       "earlier artifacts (fewest changes, then newest), component by component: "
                       "`sdk 2.20.0 → 2.21.0`, `flag -O2 → -O3`, `bucket input_ids: int64[4, 512] is new`. "
                       "The model is matched by name when the build gave one, else by content. For a hit the "
                       "same comparison says how its artifact differs from the one before it.")
def miss(build_id: int) -> Response:
    g.build_id = build_id
    with web().services.sessions() as session:
        return respond(MissOut, miss_document(session, readers.require_build(session, build_id)))


@bp.get("/<ledger_id:build_id>")
@operation(summary="A build: state, buckets, events, and the artifact once published", tag="builds",
           access=Permission.READ,
           description="The build's state and cache outcome, each bucket's compile (state, attempts, worker, "
                       "times, the failure history, and where it came from: compiled by this build, joined, "
                       "reused or a remembered failure), the state changes in order, and the published "
                       "artifact with download URLs once every bucket succeeded. 404 for a build this token's "
                       "team may not read, as for one that does not exist.",
           responses={200: BuildOut}, problems=(404,))
def get_build(build_id: int) -> Response:
    g.build_id = build_id
    ctx = web()
    return respond(BuildOut, document_of(ctx, *load_build(ctx, build_id)))


def run_control(build_id: int, action: Callable[[Services, int, Principal | None], object]) -> WebContext:
    """Cancel or retry (``action``) build ``build_id`` for the request's token (its team's builds, or any for
    an admin: :mod:`compilesvc.builds.control` decides), refusals as problems; the API's views and the UI's forms."""
    g.build_id = build_id
    ctx = web()
    if readers.reader().bounded:  # under the team boundary another team's build does not exist: 404, not 403
        with ctx.services.sessions() as session:
            readers.require_build(session, build_id)
    try:
        action(ctx.services, build_id, current_principal())
    except BuildNotFound:
        raise Problem("build-not-found", f"no build {build_id}") from None
    except SubmitRefused as exc:
        raise refused(exc) from None
    return ctx


def _state_response(ctx: WebContext, build_id: int, status: int) -> Response:
    with ctx.services.sessions() as session:
        row = session.execute(
            select(Build.state, Artifact.state).join(Artifact, Artifact.id == Build.artifact_id)
            .where(Build.id == build_id)
        ).one()
    status_url = ctx.build_url(build_id)
    body = {"build_id": build_id, "state": row[0], "artifact_state": row[1], "status_url": status_url}
    return respond(BuildStateOut, body, status, {"Location": status_url} if status == 202 else None)


@bp.post("/<ledger_id:build_id>/cancel")
@operation(summary="Cancel a build", tag="builds", access=Permission.SUBMIT,
           description="The build is cancelled at once; its compiles only when no other build waits for them.",
           responses={200: BuildStateOut}, problems=(404, 409))
def cancel(build_id: int) -> Response:
    return _state_response(run_control(build_id, cancel_build), build_id, 200)


@bp.post("/<ledger_id:build_id>/retry")
@operation(summary="Retry a build's failed or cancelled compiles", tag="builds", access=Permission.SUBMIT,
           description="Queues the build's failed and cancelled compiles again (a compile error is cached for its "
                       "key until someone retries it) and makes the build `building` again; the compiles that "
                       "succeeded are kept. 409 when there is nothing to retry.",
           responses={202: BuildStateOut}, problems=(404, 409),
           response_headers={202: {"Location": "The build's status URL."}})
def retry(build_id: int) -> Response:
    return _state_response(run_control(build_id, retry_build), build_id, 202)
