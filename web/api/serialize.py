"""Ledger rows and core results as the documents of :mod:`web.contract.schemas`, in the plain form the views hand to
:func:`web.api.params.respond`, which validates each against its documented model and serialises it from there
(about as fast as json.dumps of the dict was: pydantic-core and orjson)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from compilesvc.builds.provenance import Origin
from compilesvc.builds.submit import SubmitResult
from compilesvc.compiles.bucket_compiles import BucketView
from compilesvc.compiles.logs import LogEntry
from compilesvc.ledger.models import BucketCompile, Build, Event
from web.context import WebContext


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def bucket_json(bucket: BucketView, origin: Origin | None = None) -> dict[str, Any]:
    return {
        "key": bucket.key, "position": bucket.position, "inputs": bucket.inputs, "state": bucket.state,
        "attempts": bucket.attempts, "error_class": bucket.error_class, "error_code": bucket.error_code,
        "error_message": bucket.error_message, "worker_id": bucket.worker_id,
        "cancel_requested": bucket.cancel_requested, "interruptions": bucket.interruptions,
        "started_at": iso(bucket.started_at), "finished_at": iso(bucket.finished_at),
        "compile_seconds": bucket.compile_seconds, "queued_at": iso(bucket.queued_at),
        "origin": None if origin is None else {"how": str(origin.how), "from_build": origin.from_build,
                                               "again_by": origin.again_by},
        "errors": [{**failure.as_dict(), "at": iso(failure.at)} for failure in bucket.failures],
    }


def bucket_row_json(bucket: BucketCompile, position: int) -> dict[str, Any]:
    return bucket_json(BucketView.of(bucket, position))


def accepted_json(ctx: WebContext, result: SubmitResult) -> dict[str, Any]:
    return {
        "build_id": result.build_id, "state": result.state, "outcome": result.outcome,
        "replayed": result.replayed, "artifact_key": result.artifact_key,
        "artifact_state": result.artifact_state, "buckets": [bucket_json(b) for b in result.buckets],
        "status_url": ctx.build_url(result.build_id), "logs_url": ctx.build_url(result.build_id, "/logs"),
        "artifact": None,  # a hit carries the cached artifact, added by the view
    }


def summary_json(ctx: WebContext, build: Build) -> dict[str, Any]:
    return {
        "build_id": build.id, "state": build.state, "outcome": build.outcome, "artifact_key": build.artifact_key,
        "model_name": build.model_name, "model_sha256": build.model_sha256, "target": build.target,
        "sdk": build.sdk, "backend": build.backend, "submitted_by": build.submitted_by,
        "labels": build.labels, "created_at": iso(build.created_at), "finished_at": iso(build.finished_at),
        "buckets_reused": build.buckets_reused, "status_url": ctx.build_url(build.id),
    }


def event_json(event: Event) -> dict[str, Any]:
    return {"id": event.id, "at": iso(event.at), "entity": event.entity, "entity_id": event.entity_id,
            "from_state": event.from_state, "to_state": event.to_state, "detail": event.detail}


def log_json(entry: LogEntry) -> dict[str, Any]:
    return {"id": entry.id, "bucket_key": entry.bucket_key, "attempt": entry.attempt, "at": iso(entry.at),
            "stream": entry.stream, "line": entry.line}
