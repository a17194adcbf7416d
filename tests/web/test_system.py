"""Health, readiness, metrics, the worker registry, OpenAPI and docs, problem types, request logging."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from compilesvc import jsonlog
from compilesvc.dispatch import registry
from compilesvc.ledger.engine import transaction
from tests.fixtures.tokens import bearer
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem
from web.contract.schemas import ReadyOut, WorkersOut
from web.server.dependency_health import DependencyCollector

EnvFactory = Any


def test_healthz_and_readyz(sqlite_env: Env) -> None:
    health = sqlite_env.client.get("/healthz")
    assert health.status_code == 200 and health.json == {"status": "ok"}
    ready = sqlite_env.client.get("/readyz")
    assert ready.status_code == 200
    assert set(ReadyOut.model_validate(ready.json).checks) == {"database"}


def test_readiness_is_the_ledger_alone(make_env: EnvFactory, sqlite_url: str) -> None:
    """Redis stopped or the store gone: still ready (lookups need neither; issue 38: a blip of either must not
    take every API pod out of its Service), each reported down on /metrics instead. The ledger down: 503."""
    no_broker = make_env(sqlite_url, broker_url="redis://127.0.0.1:1/0", config={"METRICS_CACHE_SECONDS": 0})
    assert no_broker.client.get("/readyz").status_code == 200
    values = samples(no_broker.client.get("/metrics").get_data(as_text=True))
    assert values[("compilesvc_dependency_up", (("dependency", "broker"),))] == 0
    assert values[("compilesvc_dependency_up", (("dependency", "store"),))] == 1

    no_store = make_env(sqlite_url, config={"METRICS_CACHE_SECONDS": 0})
    shutil.rmtree(no_store.settings.resolved_store_url.removeprefix("file://"))
    assert no_store.client.get("/readyz").status_code == 200
    values = samples(no_store.client.get("/metrics").get_data(as_text=True))
    assert values[("compilesvc_dependency_up", (("dependency", "store"),))] == 0

    no_db = make_env("postgresql+psycopg://postgres@127.0.0.1:1/nothing", with_token=False)  # readyz is public
    body = assert_problem(no_db.client.get("/readyz"), 503, "not-ready")
    assert body["failed"] == ["database"] and body["checks"]["database"].startswith("failed:")
    # And a ledger outage on a normal request, checking its token first, is a 503, not a 500 (nor a 401).
    assert_problem(no_db.client.get("/v1/builds", headers=bearer("csvc_" + "x" * 40)), 503, "ledger-unavailable")


def test_a_hanging_dependency_reads_down_within_the_scrape_budget() -> None:
    release = threading.Event()
    collector = DependencyCollector({"store": lambda: release.wait(30) and None, "broker": lambda: None},
                                    cache_seconds=0, timeout=0.3)
    try:
        started = time.monotonic()
        results = collector.results()
        assert time.monotonic() - started < 5
        assert not results["store"].up and "no answer within 0.3 s" in results["store"].error
        assert results["broker"].up
        # The hung check is not started again while it runs: one thread per dependency, not one per scrape.
        threads = sum(1 for t in threading.enumerate() if t.name == "dependency-check-store")
        collector.results()
        assert sum(1 for t in threading.enumerate() if t.name == "dependency-check-store") == threads == 1
    finally:
        release.set()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, config={"METRICS_CACHE_SECONDS": 0})
    spec = spec_for(env.upload())
    build_id = env.submit(spec).json["build_id"]
    env.submit(spec)  # join
    complete_build(env.services, build_id, compile_seconds=42.0)
    env.submit(spec)  # hit
    env.submit(spec_for(env.upload(b"another model")))  # new, queued

    response = env.client.get("/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    values = samples(response.get_data(as_text=True))

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted(labels.items())))]

    cpu = {"sdk": "2.13.0", "target": "cpu"}
    assert value("compilesvc_submits_total", **cpu) == 4
    for outcome, count in (("new", 2), ("join", 1), ("hit", 1)):
        assert value("compilesvc_submit_outcomes_total", outcome=outcome, **cpu) == count
    assert value("compilesvc_compiles", outcome="succeeded", **cpu) == 2
    assert value("compilesvc_compile_seconds_count", **cpu) == 2
    assert value("compilesvc_compile_seconds_sum", **cpu) == 84.0
    assert value("compilesvc_compile_seconds_bucket", le="30.0", **cpu) == 0
    assert value("compilesvc_compile_seconds_bucket", le="60.0", **cpu) == 2
    assert value("compilesvc_compile_seconds_bucket", le="+Inf", **cpu) == 2
    assert value("compilesvc_queue_depth", queue="compile.cpu.2.13.0") == 2
    assert value("compilesvc_ledger_up") == 1
    assert value("compilesvc_workers_live") == 0


def test_workers(sqlite_env: Env) -> None:
    env = sqlite_env
    with transaction(env.services.sessions) as session:
        registry.register(session, "w1", "host-a", {"targets": ["cpu"]}, ["compile.cpu.2.13.0"], 2)
        registry.register(session, "w2", "host-b", {"targets": ["inf2"]}, ["compile.inf2.2.20.0"], 1)
        registry.mark_stopped(session, "w2")
    env.submit(spec_for(env.upload()))
    body = WorkersOut.model_validate(env.client.get("/v1/workers").json)
    assert [w.id for w in body.workers] == ["w1"] and body.workers[0].live
    queue = {q.name: q for q in body.queues}["compile.cpu.2.13.0"]
    assert queue.live_workers == 1 and queue.queued == 2
    everyone = WorkersOut.model_validate(env.client.get("/v1/workers?all=true").json)
    assert {w.id: w.live for w in everyone.workers} == {"w1": True, "w2": False}
    # With a live capable worker, submits no longer need queue_anyway.
    assert env.submit(spec_for(env.upload(b"other")), queue_anyway=False).status_code == 202


def test_openapi_validates(sqlite_env: Env) -> None:
    from openapi_spec_validator import validate

    validate(sqlite_env.client.get("/openapi.json").json)  # OpenAPI 3.1 and its JSON Schema dialect


def test_openapi_and_docs(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = env.client.get("/openapi.json").json
    assert spec["openapi"] == "3.1.0"
    documented = {(path, method) for path, item in spec["paths"].items() for method in item}
    for rule in env.app.url_map.iter_rules():
        if rule.rule.startswith("/v1/") or rule.rule in ("/healthz", "/readyz", "/metrics"):
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
            for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}:
                assert (path, method.lower()) in documented, (path, method)
    submit = spec["paths"]["/v1/builds"]["post"]
    ref = submit["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "target", "sdk"} <= set(schema["required"])  # buckets or neuron_config: by model.format
    assert {"buckets", "neuron_config"} <= set(schema["properties"])
    assert {"200", "202", "400", "413", "422", "503"} <= set(submit["responses"])
    assert submit["responses"]["422"]["content"]["application/problem+json"]

    docs = env.client.get("/docs")
    assert docs.status_code == 200 and docs.mimetype == "text/html"
    html = docs.get_data(as_text=True)
    assert "/v1/builds/{build_id}/logs/stream" in html and 'id="problem-spec-invalid"' in html
    assert "<script src=\"http" not in html and "<link rel=\"stylesheet\" href=\"http" not in html

    moved = env.client.get("/problems/spec-invalid")
    assert moved.status_code == 303 and moved.headers["Location"].endswith("/docs#problem-spec-invalid")
    assert_problem(env.client.get("/problems/nonsense"), 404)


def test_unknown_routes_and_methods(sqlite_env: Env) -> None:
    assert_problem(sqlite_env.client.get("/v1/nothing"), 404)
    response = sqlite_env.client.put("/v1/artifacts/resolve")
    body = assert_problem(response, 405)
    assert body["type"] == "about:blank" and body["title"] == "Method Not Allowed"
    assert "POST" in response.headers["Allow"]


@pytest.fixture
def json_log() -> Any:
    stream = io.StringIO()
    handler = jsonlog.configure("INFO", stream=stream, service="api")
    yield stream
    logging.getLogger().removeHandler(handler)


def test_one_json_log_line_per_request(sqlite_env: Env, json_log: io.StringIO) -> None:
    env = sqlite_env
    build_id = env.submit(spec_for(env.upload())).json["build_id"]
    json_log.truncate(0)
    json_log.seek(0)
    env.client.get(f"/v1/builds/{build_id}")
    env.client.get("/v1/builds/99999")
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    access = [line for line in lines if line["logger"] == "compilesvc.web.access"]
    assert len(access) == 2
    first, second = access
    assert first["method"] == "GET" and first["path"] == f"/v1/builds/{build_id}" and first["status"] == 200
    assert first["build_id"] == build_id and isinstance(first["duration_ms"], float)
    assert first["service"] == "api" and first["level"] == "INFO" and first["ts"].endswith("Z")
    assert second["status"] == 404 and second["build_id"] == 99999


def test_documented_integer_bounds_are_the_enforced_ones(sqlite_env: Env) -> None:
    """The OpenAPI document and the validation come from one declaration: every integer query parameter
    is refused just outside the bounds the document states, with a problem naming it."""
    env = sqlite_env
    checked = 0
    for path, item in env.client.get("/openapi.json").json["paths"].items():
        for method, op in item.items():
            for param in op.get("parameters", []):
                schema = param["schema"]
                if param["in"] != "query" or schema.get("type") != "integer":
                    continue
                url = path.replace("{build_id}", "1").replace("{sha256}", "0" * 64)
                outside = [schema["minimum"] - 1] if "minimum" in schema else []
                outside += [schema["maximum"] + 1] if "maximum" in schema else []
                refusals = sorted(int(status) for status in op["responses"] if status.startswith("4"))
                for value in outside:
                    response = env.client.open(url, method=method.upper(), query_string={param["name"]: value})
                    assert response.status_code in refusals[:1], (url, param["name"], response.status_code)
                    body = assert_problem(response, response.status_code)
                    assert param["name"] in json.dumps(body), (url, param["name"], value, body)
                    checked += 1
    assert checked >= 6  # /v1/builds limit, /logs after and limit, /logs/stream after
