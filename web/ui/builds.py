"""Build pages: the history (filters, keyset pages, live rows) and one build (provenance, buckets, log,
failure, artifact, the key and why it missed), with the cancel and retry forms."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, get_args

from flask import Response, current_app, redirect, render_template, request, stream_with_context, url_for
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from werkzeug.wrappers import Response as WerkzeugResponse

from compilesvc.access import team_reads
from compilesvc.access.tokens import Permission, Principal
from compilesvc.builds.control import cancel_build, retry_build
from compilesvc.builds.provenance import How, cache_outcome
from compilesvc.client.terminal_text import visible
from compilesvc.compiles.bucket_compiles import positioned_buckets
from compilesvc.compiles.logs import bucket_tail, read_build_logs, tail_after
from compilesvc.insights.history import (
    BUILD_STATES,
    MAX_LIMIT,
    HistoryFilter,
    InvalidCursor,
    count_by_state,
    failure_of_artifacts,
    list_builds,
)
from compilesvc.ledger.models import Build
from compilesvc.services import Services
from compilesvc.spec.compile_spec import Target
from compilesvc.spec.parsing import validation_errors
from compilesvc.states import Outcome
from web import auth, readers
from web.api.builds import document_of, load_build, miss_document, run_control
from web.api.serialize import summary_json
from web.context import web
from web.contract.access import access
from web.contract.inputs import FILTERS
from web.ui import bp
from web.ui.signed import provenance_view

#: The filter forms' target choices: the spec's targets.
TARGETS: tuple[str, ...] = get_args(Target)
#: Lines a build page opens with (the newest); the whole log is one link away.
LOG_TAIL = 500
#: Compiler lines shown under a failed bucket's message.
ERROR_LINES = 30


def _page_size() -> int:
    text = request.args.get("limit") or str(current_app.config["UI_PAGE_SIZE"])
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise ValueError(f"limit: a whole number from 1 to {MAX_LIMIT}")
    return int(text)


@bp.get("/")
@access(Permission.READ)
def history() -> tuple[str, int]:
    ctx = web()
    given = {name: request.args.get(name, "") for name in FILTERS}
    cursor = request.args.get("cursor") or None
    error = None
    items: list[dict[str, Any]] = []
    next_url = None
    counts = {}
    kept = {k: v for k, v in given.items() if v}
    if request.args.get("limit"):
        kept["limit"] = request.args["limit"]
    try:
        limit = _page_size()
        filters = HistoryFilter(**{k: v for k, v in given.items() if v})
        with ctx.services.sessions() as session:
            page = list_builds(session, filters, limit=limit, cursor=cursor, reader=readers.reader())
            failed = failure_of_artifacts(session, [b.artifact_id for b in page.items if b.state == "failed"])
            for build in page.items:
                item = summary_json(ctx, build)
                item["cache"] = cache_outcome(build.outcome, build.provenance)
                item["failure"] = failed.get(build.artifact_id)
                items.append(item)
            counts = count_by_state(session, reader=readers.reader())
        if page.next_cursor:
            next_url = "/?" + urllib.parse.urlencode({**kept, "cursor": page.next_cursor})
    except ValidationError as exc:
        error = "; ".join(f"{e['field']}: {e['message']}" for e in validation_errors(exc))
    except (InvalidCursor, ValueError) as exc:
        error = str(exc)
    status = 400 if error else 200
    first_url = ("/?" + urllib.parse.urlencode(kept)) if cursor is not None else None
    return render_template("history.html", items=items, given=given, next_url=next_url, error=error,
                           counts=counts, states=BUILD_STATES, targets=TARGETS, first_url=first_url,
                           limit=request.args.get("limit", "")), status


def _error_lines(session: Session, buckets: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The compiler's last lines of each failed bucket's failing attempt (this build's own compile or the
    remembered failure it joined), by bucket key. Attempt numbers start again at a retry, so the lines are
    also bounded by time: after the failure before it, up to the failure itself."""
    found = {}
    for bucket in buckets:
        failed = [e for e in bucket["errors"] if e["phase"] == "compile"]
        if bucket["state"] != "failed" or bucket.get("compile_id") is None or not failed:
            continue
        last = failed[-1]
        earlier = [e["at"] for e in bucket["errors"] if e["at"] < last["at"]]
        found[bucket["key"]] = bucket_tail(session, bucket["compile_id"], last["attempt"], ERROR_LINES,
                                           after=_at(earlier[-1]) if earlier else None, until=_at(last["at"]))
    return found


@bp.get("/builds/<ledger_id:build_id>")
@access(Permission.READ)
def build_page(build_id: int) -> str:
    ctx = web()
    detail, views = load_build(ctx, build_id)
    build, artifact = document_of(ctx, detail, views), detail.artifact
    for bucket, view in zip(build["buckets"], views, strict=True):
        bucket["compile_id"] = view.compile_id
    with ctx.services.sessions() as session:
        # Only a new build's key missed; a join's key is its artifact's, made by the artifact's first build.
        miss = miss_document(session, detail.build) if build["outcome"] == Outcome.NEW else None
        error_lines = _error_lines(session, build["buckets"])
        tail = tail_after(session, build_id, LOG_TAIL)
        key_owner = session.scalar(select(func.min(Build.id)).where(
            Build.artifact_id == artifact.id, *team_reads.build_conditions(readers.reader())))
    team = detail.build.team
    _sign_failure_logs(ctx, build)
    # Buckets compile at once and their log lines interleave: each line is labelled with its bucket.
    positions = {bucket["key"]: bucket["position"] for bucket in build["buckets"]}
    hows = [(bucket.get("origin") or {}).get("how") for bucket in build["buckets"]]
    remembered = [b for b, how in zip(build["buckets"], hows, strict=True) if how == How.FAILED]
    who = auth.signed_in()
    return render_template("build.html", build=build, positions=positions, miss=miss, error_lines=error_lines,
                           components=artifact.components, material=artifact.material, log_after=tail,
                           log_tail=LOG_TAIL, remembered=remembered, compiled_any=How.COMPILED in hows,
                           may_control=who is not None and who.may_control(team), key_owner=key_owner,
                           cache=cache_outcome(detail.build.outcome, detail.build.provenance),
                           timeline=timeline(build),
                           provenance=provenance_view(ctx, artifact.key, build["artifact_state"]))


def _sign_failure_logs(ctx: Any, build: dict[str, Any]) -> None:
    """A download link for every failed attempt's archived compile log (the central log holds the same
    lines; the archive is the file the worker wrote, whole)."""
    ttl = ctx.settings.url_ttl_seconds
    for bucket in build["buckets"]:
        for error in bucket["errors"]:
            if error.get("log_sha256"):
                name = f"bucket-{bucket['position']}-attempt-{error['attempt']}.log"
                error["log_url"] = ctx.services.store.blob_url(error["log_sha256"], expires_in=ttl, filename=name)


def timeline(build: dict[str, Any]) -> dict[str, Any]:
    """Where each of this build's own compiles waited and ran, as percentages of the build's span (a bar
    per bucket: queued → started → finished); reused buckets ran before the build and are not drawn."""
    start = _at(build["created_at"])
    ends = [_at(b["finished_at"]) for b in build["buckets"] if b["finished_at"]]
    end = _at(build["finished_at"]) if build["finished_at"] else datetime.now(UTC)
    end = max([end, *ends]) if ends else end
    span = max((end - start).total_seconds(), 0.001)
    bars = {}
    for bucket in build["buckets"]:
        origin = bucket.get("origin") or {}
        if origin.get("how") not in (How.COMPILED, How.JOINED, How.UNRECORDED) or origin.get("again_by"):
            continue
        queued = max(_at(bucket["queued_at"]), start) if bucket["queued_at"] else start
        started = _at(bucket["started_at"]) if bucket["started_at"] else None
        finished = _at(bucket["finished_at"]) if bucket["finished_at"] else None

        def pct(moment: datetime) -> float:
            return round(min(max((moment - start).total_seconds() / span, 0.0), 1.0) * 100, 2)

        wait_end = started or finished or end
        bars[bucket["key"]] = {
            "wait_left": pct(queued), "wait_width": max(pct(wait_end) - pct(queued), 0.3),
            "run_left": pct(started) if started else None,
            "run_width": max(pct(finished or end) - pct(started), 0.3) if started else None,
            "waited": ((started or finished or end) - queued).total_seconds(),
            "ran": ((finished or end) - started).total_seconds() if started else None,
        }
    return {"span": span, "bars": bars}


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value)


@bp.get("/builds/<ledger_id:build_id>/log.txt")
@access(Permission.READ)
def full_log(build_id: int) -> Response:
    """The whole central log of a build as text, every line labelled with its bucket and attempt, each control
    character shown as ``\\xNN`` (the file is read in terminals: ``curl …/log.txt``); ``?raw=1``: as logged."""
    ctx = web()
    shown: Callable[[str], str] = str if request.args.get("raw") in ("1", "true") else visible
    with ctx.services.sessions() as session:
        artifact_id = readers.require_build(session, build_id).artifact_id
        positions = {bucket.key: position for bucket, position in positioned_buckets(session, artifact_id)}

    def lines() -> Iterator[str]:
        after = 0
        while True:
            with ctx.services.sessions() as session:
                entries = read_build_logs(session, build_id, after=after, limit=1000)
            for entry in entries:
                yield (f"{entry.at.strftime('%H:%M:%S')} [{positions.get(entry.bucket_key, '?')}] "
                       f"#{entry.attempt} {shown(entry.line)}\n")
            if len(entries) < 1000:
                return
            after = entries[-1].id

    return Response(stream_with_context(lines()), mimetype="text/plain",
                    headers={"Content-Disposition": f'inline; filename="build-{build_id}.log"'})


@bp.post("/builds/<ledger_id:build_id>/cancel")
@access(Permission.SUBMIT)
def cancel_build_form(build_id: int) -> WerkzeugResponse:
    return _control(build_id, cancel_build)


@bp.post("/builds/<ledger_id:build_id>/retry")
@access(Permission.SUBMIT)
def retry_build_form(build_id: int) -> WerkzeugResponse:
    return _control(build_id, retry_build)


def _control(build_id: int, action: Callable[[Services, int, Principal | None], object]) -> WerkzeugResponse:
    """The build page's cancel and retry forms: what the API does, then back to the page."""
    run_control(build_id, action)
    return redirect(url_for("ui.build_page", build_id=build_id), 303)


