"""Build logs (paged with after=N, and as Server-Sent Events) and cancel/retry status codes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from tests.web.support import Env, add_log_lines, complete_build, fail_build, spec_for
from tests.web.test_submit import assert_problem
from web.contract.schemas import BuildStateOut, LogPage

EnvFactory = Any


def sse_events(raw: str) -> list[dict[str, Any]]:
    """Parse an SSE body into [{event, id, data}] (comments and retry fields skipped)."""
    events = []
    for frame in raw.split("\n\n"):
        fields: dict[str, Any] = {}
        for line in frame.splitlines():
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if "event" in fields:
            fields["data"] = json.loads(fields["data"])
            events.append(fields)
    return events


def test_logs_after_and_limit(env: Env) -> None:
    build = env.submit(spec_for(env.upload())).json
    build_id = build["build_id"]
    add_log_lines(env.services, build_id, [f"line {i}" for i in range(5)])

    page = LogPage.model_validate(env.client.get(f"/v1/builds/{build_id}/logs?limit=2").json)
    assert [line.line for line in page.lines] == ["line 0", "line 1"]
    assert page.next_after == page.lines[-1].id and not page.finished and page.build_state == "building"
    rest = LogPage.model_validate(env.client.get(f"/v1/builds/{build_id}/logs?after={page.next_after}").json)
    assert [line.line for line in rest.lines] == ["line 2", "line 3", "line 4"]
    assert not rest.finished, "still building: more lines may come"
    empty = env.client.get(f"/v1/builds/{build_id}/logs?after={rest.next_after}").json
    assert empty["lines"] == [] and empty["next_after"] == rest.next_after

    complete_build(env.services, build_id, log_lines=("compiling", "done"))
    tail = LogPage.model_validate(env.client.get(f"/v1/builds/{build_id}/logs?after={rest.next_after}").json)
    assert [line.line for line in tail.lines] == ["compiling", "done", "compiling", "done"]  # two buckets
    assert tail.finished and tail.build_state == "succeeded"
    assert len({line.bucket_key for line in tail.lines}) == 2

    assert_problem(env.client.get("/v1/builds/999/logs"), 404, "build-not-found")
    assert_problem(env.client.get(f"/v1/builds/{build_id}/logs?after=-1"), 400, "invalid-request")
    assert_problem(env.client.get(f"/v1/builds/{build_id}/logs?limit=100000"), 400, "invalid-request")


def test_sse_finished_build_and_last_event_id(sqlite_env: Env) -> None:
    env = sqlite_env
    build_id = env.submit(spec_for(env.upload(), buckets=((1, 8),))).json["build_id"]
    add_log_lines(env.services, build_id, ["a", "b", "c"])
    complete_build(env.services, build_id, log_lines=("d",))

    response = env.client.get(f"/v1/builds/{build_id}/logs/stream")
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    events = sse_events(response.get_data(as_text=True))
    assert [e["data"]["line"] for e in events if e["event"] == "line"] == ["a", "b", "c", "d"]
    assert events[-1]["event"] == "end" and events[-1]["data"]["state"] == "succeeded"
    ids = [int(e["id"]) for e in events if e["event"] == "line"]
    assert ids == sorted(ids)

    resumed = env.client.get(f"/v1/builds/{build_id}/logs/stream", headers={"Last-Event-ID": str(ids[1])})
    assert [e["data"]["line"] for e in sse_events(resumed.get_data(as_text=True)) if e["event"] == "line"] == [
        "c", "d"]
    by_query = env.client.get(f"/v1/builds/{build_id}/logs/stream?after={ids[2]}")
    assert [e["data"]["line"] for e in sse_events(by_query.get_data(as_text=True)) if e["event"] == "line"] == ["d"]

    assert_problem(env.client.get("/v1/builds/424242/logs/stream"), 404, "build-not-found")
    assert_problem(env.client.get(f"/v1/builds/{build_id}/logs/stream", headers={"Last-Event-ID": "x"}), 400)


def test_sse_live_lines_and_bounded_lifetime(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, config={"SSE_POLL_SECONDS": 0.05, "SSE_MAX_SECONDS": 1.0,
                                       "SSE_HEARTBEAT_SECONDS": 0.2})
    build_id = env.submit(spec_for(env.upload(), buckets=((1, 8),))).json["build_id"]
    add_log_lines(env.services, build_id, ["before"])

    def later() -> None:
        time.sleep(0.3)
        add_log_lines(env.services, build_id, ["during"])

    writer = threading.Thread(target=later)
    started = time.monotonic()
    writer.start()
    raw = env.client.get(f"/v1/builds/{build_id}/logs/stream").get_data(as_text=True)
    writer.join()
    elapsed = time.monotonic() - started
    events = sse_events(raw)
    assert [e["data"]["line"] for e in events] == ["before", "during"]
    assert all(e["event"] == "line" for e in events), "no end event while the build is still building"
    assert ": keep-alive" in raw
    assert raw.startswith("retry: ")
    assert 0.9 < elapsed < 5


def test_sse_streams_are_capped_per_process(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, config={"SSE_MAX_STREAMS": 1, "SSE_POLL_SECONDS": 0.05, "SSE_MAX_SECONDS": 0.3})
    build_id = env.submit(spec_for(env.upload(), buckets=((1, 8),))).json["build_id"]
    held = env.client.get(f"/v1/builds/{build_id}/logs/stream", buffered=False)
    assert held.status_code == 200
    refused = env.client.get(f"/v1/builds/{build_id}/logs/stream")
    assert_problem(refused, 503, "too-many-streams")
    assert refused.headers["Retry-After"]
    held.close()  # the server closes the stream (as WSGI servers always do): its slot is free again
    for _ in range(2):  # streams that run to their end release their slot too
        with env.client.get(f"/v1/builds/{build_id}/logs/stream") as again:
            assert again.status_code == 200
            again.get_data()


def test_cancel_and_retry(env: Env) -> None:
    uri = env.upload()
    build_id = env.submit(spec_for(uri)).json["build_id"]

    cancelled = env.client.post(f"/v1/builds/{build_id}/cancel")
    assert cancelled.status_code == 200
    body = BuildStateOut.model_validate(cancelled.json)
    assert body.state == "cancelled" and body.artifact_state == "cancelled"
    assert_problem(env.client.post(f"/v1/builds/{build_id}/cancel"), 409, "not-cancellable")

    retried = env.client.post(f"/v1/builds/{build_id}/retry")
    assert retried.status_code == 202
    assert retried.json["state"] == "building" and retried.headers["Location"].endswith(f"/v1/builds/{build_id}")
    assert_problem(env.client.post(f"/v1/builds/{build_id}/retry"), 409, "not-retryable")

    fail_build(env.services, build_id)
    assert env.client.get(f"/v1/builds/{build_id}").json["state"] == "failed"
    failed = env.client.get(f"/v1/builds/{build_id}").json
    errors = [b for b in failed["buckets"] if b["error_class"]]
    assert errors[0]["error_code"] == "NCC_EXTP004" and errors[0]["state"] == "failed"
    assert env.submit(spec_for(uri)).json["outcome"] == "join", "a compile error is remembered (negative cache)"
    assert env.client.post(f"/v1/builds/{build_id}/retry").status_code == 202

    complete_build(env.services, build_id)
    assert_problem(env.client.post(f"/v1/builds/{build_id}/retry"), 409, "not-retryable")
    assert_problem(env.client.post(f"/v1/builds/{build_id}/cancel"), 409, "not-cancellable")

    for action in ("cancel", "retry"):
        assert_problem(env.client.post(f"/v1/builds/987654/{action}"), 404, "build-not-found")
        assert_problem(env.client.get(f"/v1/builds/987654/{action}"), 405)
    assert_problem(env.client.get("/v1/builds/987654"), 404, "build-not-found")
    assert_problem(env.client.get(f"/v1/builds/{2**63}"), 404)
    assert_problem(env.client.get("/v1/builds/0"), 404)
