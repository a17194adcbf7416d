"""Nothing a client can send produces a 500: random methods, paths, query strings, headers and bodies
(random bytes, random JSON, and valid specs with random mutations) against every endpoint, on both
ledgers. Every error must also be problem+json (or, for a browser on a UI page, HTML)."""

from __future__ import annotations

import copy
import json
import urllib.parse
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.web.support import Env, complete_build, spec_for
from web.contract.problems import PROBLEM_TYPES
from web.contract.schemas import ProblemDetails

EnvFactory = Any

ROUTES = [
    ("POST", "/v1/builds"), ("GET", "/v1/builds"), ("GET", "/v1/builds/{id}"),
    ("POST", "/v1/builds/{id}/cancel"), ("POST", "/v1/builds/{id}/retry"), ("GET", "/v1/builds/{id}/logs"),
    ("GET", "/v1/builds/{id}/logs/stream"), ("GET", "/v1/artifacts/{key}"), ("POST", "/v1/artifacts/resolve"),
    ("POST", "/v1/models"), ("GET", "/v1/blobs/{key}"), ("GET", "/v1/workers"), ("GET", "/healthz"),
    ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/"),
    ("GET", "/builds/{id}"), ("GET", "/problems/{code}"), ("GET", "/static/{code}"), ("GET", "/{code}"),
    ("POST", "/v1/campaigns/rollforward"), ("GET", "/v1/campaigns"), ("GET", "/v1/campaigns/{id}"),
    ("POST", "/v1/pins"), ("GET", "/v1/pins"), ("DELETE", "/v1/pins/{id}"),
    ("POST", "/v1/subscriptions"), ("GET", "/v1/subscriptions"), ("DELETE", "/v1/subscriptions/{id}"),
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
QUERY_NAMES = ["after", "limit", "cursor", "model", "target", "sdk", "state", "label", "submitted_by",
               "queue_anyway", "expires", "sig", "filename", "all"]
HEADER_NAMES = ["Idempotency-Key", "X-Submitted-By", "Last-Event-ID", "Content-Type", "Accept", "Range",
                "If-None-Match", "X-Anything"]
SPEC_PATHS = ["model", "model.uri", "model.format", "model.name", "model.version_id", "target", "sdk", "compiler",
              "compiler.backend", "compiler.args", "compiler.args.0", "compiler.tp_degree", "compiler.isa",
              "buckets", "buckets.0", "buckets.0.batch_size", "buckets.0.inputs", "buckets.1", "labels",
              "labels.team", "extra_field"]
NASTY_TEXT = ["\x00", "a\x00b", "\ud800", "x\udfffy", "", " ", "🙂" * 3, "9" * 30, "-1", "0", "1e309",
              "blob:sha256:" + "0" * 64, "s3://bucket/key", "file:///etc/passwd", "../../etc", "%00", "null"]

header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40)
any_text = st.one_of(st.text(max_size=30), st.sampled_from(NASTY_TEXT))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), any_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=4)), max_leaves=15)
plausible = st.one_of(st.sampled_from(["cpu", "inf2", "trn1", "trn2", "2.13.0", "2.20.0", "torchscript", "hlo",
                                       "exported-program", "trace", "aotinductor", "x86_64-avx512",
                                       "--freeze", "-O2"]),
                      st.integers(-2, 70), json_values)


def set_path(document: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node: Any = document
    for part in parts[:-1]:
        key: Any = int(part) if part.isdigit() else part
        if isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        elif isinstance(node, dict):
            if not isinstance(node.get(key), (dict, list)):
                node[key] = {}
            node = node[key]
        else:
            return
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if isinstance(node, list) and isinstance(last, int):
        if last < len(node):
            node[last] = value
    elif isinstance(node, dict):
        node[last] = value


def quote(text: str) -> str:
    return urllib.parse.quote(text, safe="", errors="surrogatepass")


@st.composite
def requests(draw: st.DrawFn, uri: str, build_ids: list[int], keys: list[str]) -> dict[str, Any]:
    # The spec endpoints have the most input to get wrong: weigh them up.
    method, template = draw(st.sampled_from(ROUTES + [("POST", "/v1/builds"), ("POST", "/v1/artifacts/resolve")] * 8))
    if draw(st.integers(0, 4)) == 0:
        method = draw(st.sampled_from(METHODS))
    build_id = draw(st.one_of(st.sampled_from(build_ids), st.integers(-3, 2**65).map(str), any_text))
    key = draw(st.one_of(st.sampled_from(keys), any_text))
    code = draw(st.one_of(st.sampled_from([*PROBLEM_TYPES, "style.css", "x"]), any_text))
    path = template.format(id=quote(str(build_id)), key=quote(key), code=quote(code))
    params = draw(st.dictionaries(st.one_of(st.sampled_from(QUERY_NAMES), any_text), any_text, max_size=4))
    # surrogatepass: a lone surrogate becomes the (invalid UTF-8) bytes a misbehaving client could send.
    query = urllib.parse.urlencode(params, encoding="utf-8", errors="surrogatepass")
    headers = draw(st.dictionaries(st.sampled_from(HEADER_NAMES), header_text, max_size=3))
    takes_spec = template in ("/v1/builds", "/v1/artifacts/resolve") and method == "POST"
    kind = draw(st.sampled_from(["spec"] * 6 + ["none", "bytes", "json"] if takes_spec else
                                ["none", "bytes", "json", "spec"]))
    body: bytes | None = None
    if kind == "bytes":
        body = draw(st.binary(max_size=300))
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "spec":
        spec = copy.deepcopy(spec_for(uri, labels={"team": "t"}))
        for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
            set_path(spec, draw(st.sampled_from(SPEC_PATHS)), draw(plausible))
        body = json.dumps(spec).encode()
    if kind in ("json", "spec") and draw(st.integers(0, 9)):  # mostly as a client would send it
        headers.setdefault("Content-Type", "application/json")
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body}


def fuzz(env: Env, examples: int) -> None:
    uri = env.upload(b"fuzz model")
    first = env.submit(spec_for(uri, buckets=((1, 8),))).json
    complete_build(env.services, first["build_id"])
    second = env.submit(spec_for(uri, buckets=((2, 8),))).json
    build_ids = [first["build_id"], second["build_id"]]
    keys = [first["artifact_key"], second["artifact_key"]]
    seen: Counter[tuple[str, int]] = Counter()

    plain_submit = {"method": "POST", "path": "/v1/builds", "query": "", "body": json.dumps(spec_for(uri)).encode(),
                    "headers": {"Content-Type": "application/json"}}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(request=requests(uri, build_ids, keys))
    @example(request=plain_submit)  # the run always reaches an accepted submit, whatever else it draws
    @example(request={**plain_submit, "body": b'{"model": '})  # and a malformed body (400), however it draws
    def check(request: dict[str, Any]) -> None:
        # Closed as a WSGI server would: an open log stream holds one of the process's stream slots.
        with env.client.open(request["path"], method=request["method"], query_string=request["query"],
                             headers=request["headers"], data=request["body"]) as response:
            data = response.get_data()  # streams (SSE) run to their end here
        seen[(request["method"], response.status_code)] += 1
        assert response.status_code < 500, (request, data[:500])
        if response.status_code >= 400 and request["method"] != "HEAD" and response.mimetype != "text/html":
            assert response.mimetype == "application/problem+json", (request, response.mimetype)
            ProblemDetails.model_validate(json.loads(data))

    check()
    print(sorted(seen.items()))
    statuses = {status for _, status in seen}
    # The inputs reach past routing and parsing: accepted submits, hits, spec errors, 404s, 405s.
    assert {200, 202, 400, 404, 405, 422} <= statuses, seen


@pytest.mark.slow
def test_fuzz_every_endpoint(make_env: EnvFactory, ledger_url: str) -> None:
    env = make_env(ledger_url, require_live_worker=False, max_request_bytes=64 * 1024, max_upload_bytes=1 << 20,
                   config={"SSE_POLL_SECONDS": 0.02, "SSE_MAX_SECONDS": 0.1, "SSE_HEARTBEAT_SECONDS": 0.05})
    fuzz(env, examples=250)
