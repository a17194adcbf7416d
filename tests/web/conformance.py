"""The OpenAPI conformance fuzz, as each kind of caller: schemathesis (every check it has) against the server's
own /openapi.json, every case carrying one scope's token (or none). Shared by the bounded CI test
(tests/web/contract/test_openapi_conformance.py) and the long run of ``python -m bench.fuzz``.

For each operation, requests the document allows must be accepted and requests it forbids refused, and
every answer (status, content type, headers, body) must be one the document describes; a scope that may
not call an operation gets a 401 or 403 the document lists, with the problem+json body it describes.

A schema-valid request can still be refused for reasons JSON Schema cannot state. Positive cases are made
valid in those respects before they are sent, each for a stated reason (:func:`semantically_valid`);
negative cases are sent as generated.

Failures are collected, not raised: every case of the budget runs (the count is of requests actually sent),
and each distinct failure (scope, mode, operation, check) is kept once with schemathesis' report of its
first case, curl line included. Hypothesis therefore does not shrink; the curl line reproduces the case.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode

from compilesvc.access.tokens import GRANTS, Permission, Scope
from compilesvc.services import Services
from tests.fixtures.tokens import bearer, make_token
from tests.web.support import Env, make_settings
from web.contract.access import declared_access, needed
from web.contract.openapi import openapi_path
from web.server.app import create_app

#: Every kind of caller: no token, then each scope from least to most.
SCOPES = ("none", "fleet", "read", "submit", "admin")
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
#: The cpu target's release and backend that the test environment's spec checks accept.
CPU_FRAME = {"target": "cpu", "sdk": "2.13.0", "compiler": {"backend": "torchscript", "args": [], "tp_degree": 1}}

#: 503 is no server error here: it is the documented answer (with Retry-After) when what a request needs is
#: away, such as a live worker for the target or the S3 server a model is on. A 500 still fails.
CONFIG = SchemathesisConfig.from_dict(
    {"checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]}}})

#: The app settings of a fuzzed environment: live log streams of a building build end after a second, not
#: five minutes.
APP_CONFIG = {"SSE_MAX_SECONDS": 1.0, "SSE_POLL_SECONDS": 0.1}


def spare_own_tokens(case: Any, own_token_ids: set[int], spare_token_id: int) -> None:
    """In every mode: a revoke must not name a token the run calls with (a negative case can carry a valid
    id when what it breaks is elsewhere); a spare one is revoked instead."""
    revoke = (case.operation.method.upper(), case.operation.path) == ("POST", "/v1/tokens/{token_id}/revoke")
    if revoke and (case.path_parameters or {}).get("token_id") in own_token_ids:
        case.path_parameters = {**case.path_parameters, "token_id": spare_token_id}


def semantically_valid(case: Any, model_uri: str, spare_token_id: int) -> None:
    """Make a positive case valid where JSON Schema cannot say what valid is."""
    path, method = case.operation.path, case.operation.method.upper()
    if (method, path) in {("POST", "/v1/builds"), ("POST", "/v1/artifacts/resolve")} and isinstance(case.body, dict):
        # A spec must name a model that exists, and its target, release, backend and flags must go together
        # (compilesvc.spec.compile_spec's cross-field rules); its buckets' element counts are bounded by settings.
        case.body = {**case.body, **CPU_FRAME, "model": {"uri": model_uri, "format": "torchscript"}}
        # A torchscript spec takes shape buckets (one at least) and no neuron_config: the document lists both as
        # optional because an hf-checkpoint spec takes the reverse, a rule across fields JSON Schema does not say.
        case.body.pop("neuron_config", None)
        if not case.body.get("buckets"):
            case.body["buckets"] = [{"batch_size": 1, "seq_len": 8}]
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
        # A generated id could name a token the run itself calls with; a spare one is revoked instead.
        case.path_parameters = {**(case.path_parameters or {}), "token_id": spare_token_id}
    if (method, path) == ("POST", "/v1/models"):
        # A declared digest must be the body's; a blind generator cannot know it.
        for name in ("Content-Digest", "Digest"):
            (case.headers or {}).pop(name, None)
        (case.query or {}).pop("sha256", None)


@dataclass
class Found:
    """One distinct failure: the first case's report (with its curl line) and how many cases had it."""

    scope: str
    mode: str
    operation: str
    check: str  # schemathesis' failure code and title, or the exception a request raised
    report: str
    cases: int = 1

    def describe(self) -> str:
        return f"== {self.operation} as {self.scope} ({self.mode}): {self.check} [{self.cases} case(s)]\n" \
               f"{self.report.strip()}"


@dataclass
class Tally:
    """What one scope and mode's run did: cases sent, their statuses, the distinct failures."""

    scope: str
    mode: str
    cases: int = 0
    failing_cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    found: dict[tuple[str, str], Found] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        """5xx answers, the documented 503 (something the request needs is away, Retry-After) excepted."""
        return sum(count for status, count in self.statuses.items() if status >= 500 and status != 503)

    @property
    def failures(self) -> list[Found]:
        return list(self.found.values())

    def note(self, operation: str, check: str, report: str) -> None:
        known = self.found.get((operation, check))
        if known is None:
            self.found[(operation, check)] = Found(self.scope, self.mode, operation, check, report)
        else:
            known.cases += 1


def fuzz_env(workdir: Path, database_url: str, **overrides: Any) -> Env:
    """An app to fuzz over real services (the migrated ledger at ``database_url``, a store and broker under
    ``workdir``), with an admin client; :func:`close_env` ends it. Submits are neither rate-limited nor held
    to a compile quota, so the submit scope's cases reach the submit rather than the 429 a few hundred would
    earn (both limits have tests of their own)."""
    services = Services.from_settings(make_settings(
        workdir, database_url, submit_rate_limit="1000000000/minute", max_compiles_per_token=0, **overrides))
    app = create_app(services=services, config=APP_CONFIG)
    app.testing = True
    token = make_token(services.sessions, "admin", owner="fuzz-admin")
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = bearer(token)["Authorization"]
    return Env(app=app, client=client, services=services, token=token)


def close_env(env: Env) -> None:
    env.app.extensions["compilesvc"].fetches.close()  # its last counts, while the ledger is still there
    env.services.close()


#: How many cases one scope gets for one operation in one mode.
Budget = Callable[[str, Any], int]
#: The share of a scope the access check refuses: its answer is the same 401 or 403 whatever the input, so
#: a few cases show that answer is documented; the rest go to the scopes whose answers the view decides.
REFUSED_SHARE = 0.05


class Fuzzer:
    """An environment made ready for the fuzz: a model to name in specs, a spare token to revoke, one token
    per scope, and the schema schemathesis generates from."""

    def __init__(self, env: Env):
        load_all_checks()
        self.env = env
        self.checks = CHECKS.get_all()
        self.model_uri = env.upload()
        spare = env.client.post("/v1/tokens", json={"name": "spare", "owner": "fuzz", "scopes": ["read"]})
        self.spare_token_id: int = spare.json["id"]  # type: ignore[index]
        self.headers: dict[str, dict[str, str]] = {"none": {}, "admin": bearer(env.token)}
        for scope in ("fleet", "read", "submit"):
            token = make_token(env.services.sessions, scope, owner=f"fuzz-{scope}", name=f"fuzz {scope}")
            self.headers[scope] = bearer(token)
        listed = env.client.get("/v1/tokens").json["items"]  # type: ignore[index]
        self.own_token_ids = {int(token["id"]) for token in listed} - {self.spare_token_id}
        schema = schemathesis.openapi.from_wsgi("/openapi.json", env.app, config=CONFIG)
        # An operation the document fails to describe (an Err) raises here, loudly.
        self.operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
        self._needs = self._permissions()

    def _permissions(self) -> dict[tuple[str, str], Permission | None]:
        """What each (METHOD, OpenAPI path) needs, from the same declarations the server enforces."""
        app, out = self.env.app, {}
        for rule in app.url_map.iter_rules():
            path, _ = openapi_path(rule.rule)
            permission = needed(declared_access(rule.endpoint, app.view_functions.get(rule.endpoint)),
                                self.env.settings)
            out.update({(method, path): permission for method in rule.methods or ()})
        return out

    def lets_through(self, scope: str, operation: Any) -> bool:
        """Whether ``scope``'s token passes the operation's access check (its answer is then the view's)."""
        permission = self._needs[(operation.method.upper(), operation.path)]
        if permission is None:
            return True
        return scope != "none" and permission in GRANTS[Scope(scope)]

    def split(self, per_operation: int) -> Budget:
        """About ``per_operation`` cases per operation and mode, all scopes together: each refused scope gets
        :data:`REFUSED_SHARE` of them (at least one), the scopes let through share the rest evenly."""
        refused_cases = max(1, round(per_operation * REFUSED_SHARE))

        def cases(scope: str, operation: Any) -> int:
            if not self.lets_through(scope, operation):
                return refused_cases
            allowed = sum(self.lets_through(other, operation) for other in SCOPES)
            return max(1, (per_operation - (len(SCOPES) - allowed) * refused_cases) // allowed)

        return cases

    def run(self, scope: str, mode: GenerationMode, budget: Budget) -> Tally:
        """Every operation's cases under ``mode`` as ``scope``, ``budget(scope, operation)`` of them each."""
        tally = Tally(scope, mode.value)
        started = time.monotonic()
        for operation in self.operations:
            if mode == GenerationMode.NEGATIVE and not has_inputs(operation):
                continue  # nothing to send wrong
            examples = budget(scope, operation)
            if examples > 0:
                self._exercise(operation, mode, examples, tally)
        tally.seconds = time.monotonic() - started
        return tally

    def _exercise(self, operation: Any, mode: GenerationMode, examples: int, tally: Tally) -> None:
        headers = self.headers[tally.scope]

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy(generation_mode=mode))
        def exercise(case: Any) -> None:
            spare_own_tokens(case, self.own_token_ids, self.spare_token_id)
            if mode == GenerationMode.POSITIVE:
                semantically_valid(case, self.model_uri, self.spare_token_id)
            tally.cases += 1
            try:
                response = case.call(headers=headers)
            except Exception as exc:  # an exception the app let out: a 500 behind a real server
                tally.statuses[500] += 1
                tally.failing_cases += 1
                tally.note(operation.label, f"exception {type(exc).__name__}",
                           f"{exc!r}\n" + "\n".join(getattr(exc, "__notes__", [])))
                return
            tally.statuses[response.status_code] += 1
            try:
                # With a token, the missing-auth check also sends the case without it and with a wrong one.
                case.validate_response(response, checks=self.checks, headers=headers,
                                       transport_kwargs={"headers": headers})
            except FailureGroup as group:
                tally.failing_cases += 1
                for failure in group.exceptions:
                    tally.note(operation.label, f"{failure.code} {failure.title}", str(group))
            except Exception as exc:  # a check's own request (the missing-auth probes) let an exception out
                tally.failing_cases += 1
                tally.note(operation.label, f"exception in a check: {type(exc).__name__}",
                           f"{exc!r}\n{case.as_curl_command(headers=headers)}")

        exercise()


def has_inputs(operation: Any) -> bool:
    """Whether the operation takes parameters or a body (a negative case needs something to send wrong)."""
    definition = operation.definition.raw
    return bool(definition.get("parameters") or definition.get("requestBody"))
