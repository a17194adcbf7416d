"""The OpenAPI document against the server itself, by schemathesis with every check it has: for each
operation, requests the document allows must be accepted and requests it forbids refused, and every answer
(status, content type, headers, body) must be one the document describes.

A schema-valid request can still be refused for reasons JSON Schema cannot state. Positive cases are made
valid in those respects before they are sent, each for a stated reason (:func:`semantically_valid`); negative
cases are sent as generated. The run is bounded (``EXAMPLES`` per operation and mode) to fit CI; a longer
one is `make bench`'s (issue 12).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode

from tests.fixtures.tokens import bearer
from tests.web.support import Env

#: Cases per operation and mode; COMPILESVC_FUZZ_EXAMPLES runs longer (e.g. 1000 before a release).
EXAMPLES = int(os.environ.get("COMPILESVC_FUZZ_EXAMPLES", "40"))
#: The cpu target's release and backend that the test environment's spec checks accept.
CPU_FRAME = {"target": "cpu", "sdk": "2.13.0", "compiler": {"backend": "torchscript", "args": [], "tp_degree": 1}}

#: 503 is no server error here: it is the documented answer (with Retry-After) when what a request needs is
#: away, such as a live worker for the target or the S3 server a model is on. A 500 still fails.
CONFIG = SchemathesisConfig.from_dict(
    {"checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]}}})

pytestmark = pytest.mark.slow  # hundreds of requests per mode: seconds, not the edit loop's milliseconds


def semantically_valid(case: Any, model_uri: str, spare_token_id: int) -> None:
    """Make a positive case valid where JSON Schema cannot say what valid is."""
    path, method = case.operation.path, case.operation.method.upper()
    if (method, path) in {("POST", "/v1/builds"), ("POST", "/v1/artifacts/resolve")} and isinstance(case.body, dict):
        # A spec must name a model that exists, and its target, release, backend and flags must go together
        # (compilesvc.spec's cross-field rules); its buckets' element counts are bounded by settings.
        case.body = {**case.body, **CPU_FRAME, "model": {"uri": model_uri, "format": "torchscript"}}
        for bucket in case.body.get("buckets") or []:
            for name in ("batch_size", "seq_len"):  # the {batch_size, seq_len} shorthand
                if name in bucket:
                    bucket[name] = min(bucket[name], 8)
            for index, spec_input in enumerate(bucket.get("inputs") or []):
                spec_input["name"] = f"{spec_input['name']}_{index}"  # names are unique within a bucket
                spec_input["shape"] = [min(dim, 8) for dim in spec_input["shape"]]
                assert math.prod(spec_input["shape"]) <= 8**8
    if (method, path) == ("POST", "/v1/builds"):
        # A callback must name a host that resolves to an address the service may call: DNS is no schema's.
        if isinstance(case.body, dict):
            case.body.pop("callbacks", None)
        # Without a live worker for the target a submit is a documented 503, which the server-error check
        # counts as a failure; this environment has no workers.
        case.query = {**(case.query or {}), "queue_anyway": "true"}
        # A key sent again with another body is refused (Stripe's semantics); generated keys repeat.
        (case.headers or {}).pop("Idempotency-Key", None)
    same_release = isinstance(case.body, dict) and case.body.get("from_sdk") == case.body.get("to_sdk")
    if (method, path) == ("POST", "/v1/campaigns/rollforward") and same_release:
        # Moving a release onto itself is refused: the two fields must differ, which JSON Schema cannot say.
        case.body["to_sdk"] = "0.0.1" if case.body["from_sdk"] == "0.0.0" else "0.0.0"
    if (method, path) == ("POST", "/v1/subscriptions") and isinstance(case.body, dict):
        # The URL must be one the service may call: what a host resolves to is no schema's (a public IP
        # literal needs no DNS, and nothing is sent: this run has no relay).
        case.body["url"] = "http://93.184.216.34/hook"
    if (method, path) == ("GET", "/v1/builds") and case.query:
        case.query.pop("cursor", None)  # a cursor is one the server issued; which ones, no schema can say
    if (method, path) == ("POST", "/v1/tokens/{token_id}/revoke"):
        # A generated id could name the token the run itself calls with; a spare one is revoked instead.
        case.path_parameters = {**(case.path_parameters or {}), "token_id": spare_token_id}
    if (method, path) == ("POST", "/v1/models"):
        # A declared digest must be the body's; a blind generator cannot know it.
        for name in ("Content-Digest", "Digest"):
            (case.headers or {}).pop(name, None)
        (case.query or {}).pop("sha256", None)


def run_operations(env: Env, mode: GenerationMode) -> dict[str, str]:
    """Every operation's failures (one line each) under ``mode``."""
    load_all_checks()
    checks = CHECKS.get_all()
    model_uri = env.upload()
    spare = env.client.post("/v1/tokens", json={"name": "spare", "owner": "fuzz", "scopes": ["read"]})
    spare_token_id = spare.json["id"]
    schema = schemathesis.openapi.from_wsgi("/openapi.json", env.app, config=CONFIG)
    failures: dict[str, str] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and not _has_inputs(operation):
            continue  # nothing to send wrong

        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy(generation_mode=mode))
        def exercise(case: Any) -> None:
            if mode == GenerationMode.POSITIVE:
                semantically_valid(case, model_uri, spare_token_id)
            # Every case carries the admin token; the missing-auth check sends each one without it as well.
            case.call_and_validate(checks=checks, headers=bearer(env.token))

        try:
            exercise()
        except BaseException as exc:  # schemathesis reports a group of failures; keep the first line of each
            failures[f"{operation.label} ({mode.value})"] = "\n".join(
                line for line in str(exc).splitlines() if line.strip())
    return failures


def _has_inputs(operation: Any) -> bool:
    definition = operation.definition.raw
    return bool(definition.get("parameters") or definition.get("requestBody"))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_the_server_does_what_its_openapi_document_says(make_env: Any, sqlite_url: str,
                                                       mode: GenerationMode) -> None:
    # Live log streams of a building build end after a second, not five minutes.
    env = make_env(sqlite_url, config={"SSE_MAX_SECONDS": 1.0, "SSE_POLL_SECONDS": 0.1})
    failures = run_operations(env, mode)
    assert not failures, "\n\n".join(f"== {label}\n{text}" for label, text in failures.items())
