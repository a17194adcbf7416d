"""Who may do what: every endpoint against the scope matrix of docs/security.md, token errors, teams, the
UI's login session and CSRF, the JSON-only rule, and the settings that open reads and metrics."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from flask.testing import FlaskClient
from sqlalchemy import select, update
from werkzeug.test import TestResponse

from compilesvc.access.tokens import token_hash
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import ApiToken, Build, utcnow
from tests.fixtures.tokens import bearer, make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
COLUMNS = ("no token", "fleet", "read", "submit", "admin", "revoked", "expired")


def matrix() -> dict[tuple[str, str], dict[str, str]]:
    """docs/security.md's endpoint table: (method, path) -> {column: expected}."""
    text = SECURITY_DOC.read_text()
    section = text[text.index("## Every endpoint"):]
    header = next(line for line in section.splitlines() if line.startswith("| endpoint |"))
    assert tuple(cell.strip() for cell in header.strip("|").split("|"))[1:] == COLUMNS
    rows = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(GET|POST|DELETE) ([^`]+)` \|(.*)\|", line)
        if match:
            cells = [cell.strip() for cell in match[3].split("|")]
            rows[(match[1], match[2])] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def routes(env: Env) -> set[tuple[str, str]]:
    out = set()
    for rule in env.app.url_map.iter_rules():
        path = re.sub(r"<(?:\w+(?:\([^)]*\))?:)?(\w+)>", r"{\1}", rule.rule)
        for long_name in ("{build_id}", "{token_id}", "{campaign_id}", "{pin_id}", "{subscription_id}",
                          "{policy_ref}"):
            path = path.replace(long_name, "{id}")  # the table's shorter name
        for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}:
            out.add((method, path))
    return out


def test_the_matrix_lists_every_endpoint(env: Env) -> None:
    assert set(matrix()) == routes(env)


class Tokens:
    """One token of every kind of the matrix, all of team "matrix"."""

    def __init__(self, env: Env):
        sessions = env.services.sessions
        self.by_column: dict[str, str | None] = {"no token": None}
        for scope in ("fleet", "read", "submit", "admin"):
            self.by_column[scope] = make_token(sessions, scope, owner=f"{scope}-user", team="matrix")
        revoked = make_token(sessions, "admin", owner="gone", team="matrix")
        expired = make_token(sessions, "admin", owner="late", team="matrix", expires_at=utcnow() + timedelta(hours=1))
        with transaction(sessions) as session:
            session.execute(update(ApiToken).where(ApiToken.token_hash == token_hash(revoked))
                            .values(revoked_at=utcnow()))
            session.execute(update(ApiToken).where(ApiToken.token_hash == token_hash(expired))
                            .values(expires_at=utcnow() - timedelta(seconds=1)))
        self.by_column.update(revoked=revoked, expired=expired)


def classify(response: TestResponse) -> str:
    """An answer as the matrix names it: a refusal by access (401, 403, a redirect to the login page), or
    ok (whatever the endpoint then answers)."""
    if response.status_code == 401:
        return "401"
    if response.status_code == 403 and response.mimetype == "application/problem+json" and \
            response.json["type"] in ("/problems/forbidden", "/problems/not-your-build"):  # type: ignore[index]
        return "403"
    if response.request.method == "GET" and response.status_code == 303 and \
            urlsplit(response.headers["Location"]).path == "/login":
        return "303"
    return "ok"


def call(client: FlaskClient, method: str, path: str, fill: dict[str, Any], token: str | None) -> TestResponse:
    url = path.format(**fill["path"])
    if path == "/v1/blobs/{sha256}":
        url = fill["blob_url"]
    headers = bearer(token) if token else {}
    kwargs: dict[str, Any] = {"headers": headers}
    body = fill["bodies"].get((method, path))
    if isinstance(body, bytes):
        kwargs.update(data=body, content_type="application/octet-stream")
    elif isinstance(body, dict) and path.startswith("/v1/"):
        kwargs["json"] = body
    elif isinstance(body, dict):
        kwargs["data"] = body
    response = client.open(url, method=method, buffered=False, **kwargs)
    response.close()  # a log stream is not read to its end
    return response


def test_every_endpoint_answers_every_token_as_the_matrix_says(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, config={"SSE_MAX_SECONDS": 0.2, "SSE_POLL_SECONDS": 0.05})
    tokens = Tokens(env)
    spec = spec_for(env.upload())
    published = env.submit(spec, **bearer(tokens.by_column["submit"] or ""))
    complete_build(env.services, published.json["build_id"])  # type: ignore[index]
    building = env.submit(spec_for(env.upload(b"another model")), **bearer(tokens.by_column["submit"] or ""))
    artifact = env.client.get(f"/v1/artifacts/{published.json['artifact_key']}").json  # type: ignore[index]
    blob_url = artifact["buckets"][0]["files"][0]["url"].removeprefix("http://api.test")
    victim = make_token(env.services.sessions, "read", owner="victim")
    fill = {
        "path": {"key": published.json["artifact_key"], "id": building.json["build_id"],  # type: ignore[index]
                 "code": "unauthorized", "filename": "style.css", "sha256": ""},
        "blob_url": blob_url,
        "bodies": {("POST", "/v1/builds"): spec, ("POST", "/v1/artifacts/resolve"): spec,
                   ("POST", "/v1/models"): b"a model", ("POST", "/login"): {"token": "x"},
                   ("POST", "/v1/tokens"): {"name": "made", "owner": "someone", "scopes": ["read"]},
                   ("POST", "/v1/campaigns/rollforward"): {"from_sdk": "2.13.0", "to_sdk": "2.14.0",
                                                            "dry_run": True},
                   ("POST", "/v1/pins"): {"kind": "model", "value": "matrix-model"},
                   ("POST", "/v1/rollforward-policies"): {"name": "matrix-policy"},
                   ("POST", "/v1/subscriptions"): {"url": "http://127.0.0.1:9/hook", "event": "build.failed"}},
    }
    with env.services.sessions() as session:
        victim_id = session.scalar(select(ApiToken.id).where(ApiToken.token_hash == token_hash(victim)))
    mismatches = []
    for (method, path), expected in sorted(matrix().items()):
        for column, want in expected.items():
            fill["path"]["id"] = victim_id if path.startswith("/v1/tokens/") else building.json["build_id"]  # type: ignore[index]
            got = classify(call(env.app.test_client(), method, path, fill, tokens.by_column[column]))
            if got != want:
                mismatches.append(f"{method} {path} with {column}: {got}, the table says {want}")
    assert not mismatches, "\n".join(mismatches)


def test_token_errors_never_tell_which_tokens_exist(env: Env) -> None:
    tokens = Tokens(env)
    details = set()
    for token in ("csvc_" + "n" * 43, tokens.by_column["revoked"], tokens.by_column["expired"]):
        body = assert_problem(env.app.test_client().get("/v1/builds", headers=bearer(token or "")), 401,
                              "unauthorized")
        details.add(body["detail"])
    assert details == {"the token is not valid (unknown, expired or revoked)"}
    missing = env.app.test_client().get("/v1/builds")
    assert "read scope" in assert_problem(missing, 401, "unauthorized")["detail"]
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="compilesvc"'
    for header in ("Basic dXNlcjpwYXNz", "Bearer", "Token csvc_abc"):
        refused = env.app.test_client().get("/v1/builds", headers={"Authorization": header})
        assert_problem(refused, 401, "unauthorized")
        assert 'error="invalid_token"' in refused.headers["WWW-Authenticate"]
    fleet = env.app.test_client().post("/v1/builds", json={}, headers=bearer(tokens.by_column["fleet"] or ""))
    body = assert_problem(fleet, 403, "forbidden")
    assert body["required_scope"] == "submit" and "this token has fleet" in body["detail"]
    assert 'scope="submit"' in fleet.headers["WWW-Authenticate"]


def test_only_the_submitting_team_or_an_admin_controls_a_build(env: Env) -> None:
    sessions = env.services.sessions
    vision = make_token(sessions, "submit", owner="ci-vision", team="vision")
    nlp = make_token(sessions, "submit", owner="ci-nlp", team="nlp")
    teammate = make_token(sessions, "submit", owner="bob", team="vision")
    build = env.submit(spec_for(env.upload()), **bearer(vision)).json
    build_id = build["build_id"]
    with sessions() as session:
        assert session.scalar(select(Build.team).where(Build.id == build_id)) == "vision"
    detail = env.client.get(f"/v1/builds/{build_id}").json
    assert detail["submitted_by"] == "ci-vision"
    refused = assert_problem(env.client.post(f"/v1/builds/{build_id}/cancel", headers=bearer(nlp)), 403,
                             "not-your-build")
    assert "team vision" in refused["detail"]
    assert env.client.post(f"/v1/builds/{build_id}/cancel", headers=bearer(teammate)).status_code == 200
    assert env.client.post(f"/v1/builds/{build_id}/retry", headers=bearer(nlp)).status_code == 403
    assert env.client.post(f"/v1/builds/{build_id}/retry").status_code == 202  # the admin
    assert_problem(env.client.post("/v1/builds/99999/cancel", headers=bearer(nlp)), 404, "build-not-found")


def test_a_cross_site_request_can_never_act(env: Env) -> None:
    spec = spec_for(env.upload())
    text_plain = {"data": json.dumps(spec), "content_type": "text/plain", "headers": {"Origin": "http://evil.example"}}
    anonymous = env.app.test_client()
    assert_problem(anonymous.post("/v1/builds", **text_plain), 401, "unauthorized")
    # Even with a token, a body that is not JSON is refused before it is read.
    assert_problem(env.client.post("/v1/builds", **text_plain), 415, "json-required")
    assert_problem(env.client.post("/v1/builds", data=json.dumps(spec)), 415, "json-required")  # no type
    form = env.client.post("/v1/builds", data={"spec": json.dumps(spec)})
    assert_problem(form, 415, "json-required")
    assert form.headers["Accept-Post"] == "application/json"
    build_id = env.submit(spec).json["build_id"]
    assert_problem(env.client.post(f"/v1/builds/{build_id}/cancel", data="x", content_type="text/plain"), 415)
    assert env.client.post(f"/v1/builds/{build_id}/cancel", json={}).status_code == 200
    assert_problem(anonymous.post(f"/v1/builds/{build_id}/retry", headers={"Origin": "http://evil.example"}),
                   401, "unauthorized")
    with env.services.sessions() as session:
        assert session.scalar(select(Build.id).where(Build.spec.is_not(None)).order_by(Build.id.desc())) == build_id


def login(client: FlaskClient, token: str, next_path: str = "/") -> TestResponse:
    page = client.get(f"/login?next={next_path}").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert csrf is not None
    return client.post("/login", data={"token": token, "csrf_token": csrf[1], "next": next_path})


def csrf_of(client: FlaskClient, path: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', client.get(path).get_data(as_text=True))
    assert found is not None
    return found[1]


def test_the_ui_logs_in_with_a_token_and_its_forms_carry_csrf_tokens(env: Env) -> None:
    reader = make_token(env.services.sessions, "read", owner="eve")
    submitter = make_token(env.services.sessions, "submit", owner="ann")
    build_id = env.submit(spec_for(env.upload()), **bearer(submitter)).json["build_id"]
    browser = env.app.test_client()

    first = browser.get(f"/builds/{build_id}")
    assert first.status_code == 303 and first.headers["Location"] == f"/login?next=/builds/{build_id}"
    refused = login(browser, "csvc_" + "w" * 40)
    assert refused.status_code == 401 and "not valid" in refused.get_data(as_text=True)
    no_csrf = browser.post("/login", data={"token": reader})
    assert no_csrf.status_code == 403
    fleet = login(browser, make_token(env.services.sessions, "fleet", owner="fleet"))
    assert fleet.status_code == 403 and "read scope" in fleet.get_data(as_text=True)

    done = login(browser, reader, f"/builds/{build_id}")
    assert done.status_code == 303 and done.headers["Location"] == f"/builds/{build_id}"
    cookie = done.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    page = browser.get(f"/builds/{build_id}").get_data(as_text=True)
    assert "eve" in page and "Cancel build" not in page  # buttons only for those allowed to press them
    # A read token's session cannot cancel, however it asks.
    token = csrf_of(browser, f"/builds/{build_id}")
    assert browser.post(f"/builds/{build_id}/cancel", data={"csrf_token": token}).status_code == 403

    assert browser.post("/logout", data={"csrf_token": token}).status_code == 303
    assert login(browser, submitter, "/").status_code == 303
    assert "Cancel build" in browser.get(f"/builds/{build_id}").get_data(as_text=True)  # the team's submitter
    token = csrf_of(browser, f"/builds/{build_id}")
    # The session's cookie alone is not enough to change anything: the CSRF token must come with it.
    assert_problem(browser.post(f"/v1/builds/{build_id}/cancel"), 403, "csrf-failed")
    assert_problem(browser.post(f"/builds/{build_id}/cancel", data={"csrf_token": "forged"}), 403, "csrf-failed")
    evil = browser.post(f"/v1/builds/{build_id}/cancel",
                        headers={"X-CSRF-Token": token, "Origin": "http://evil.example"})
    assert_problem(evil, 403, "csrf-failed")
    form = browser.post(f"/builds/{build_id}/cancel", data={"csrf_token": token},
                        headers={"Origin": "http://localhost"})
    assert form.status_code == 303 and form.headers["Location"] == f"/builds/{build_id}"
    assert env.client.get(f"/v1/builds/{build_id}").json["state"] == "cancelled"
    assert browser.post(f"/v1/builds/{build_id}/retry", headers={"X-CSRF-Token": token}).status_code == 202

    # Revoking the token ends the session.
    with env.services.sessions() as session:
        token_id = session.scalar(select(ApiToken.id).where(ApiToken.token_hash == token_hash(submitter)))
    assert env.client.post(f"/v1/tokens/{token_id}/revoke").status_code == 200
    gone = browser.get(f"/builds/{build_id}")
    assert gone.status_code == 303 and gone.headers["Location"].startswith("/login")
    assert browser.get("/login?next=//evil.example").status_code == 200
    assert 'value="/"' in browser.get("/login?next=//evil.example").get_data(as_text=True)  # no open redirect


@pytest.mark.parametrize("target", ["//evil.example", "/\t/evil.example", "/\n/evil.example", "/\\evil.example",
                                    "/ /evil.example", "https://evil.example/", "/\x7f/x", "javascript:alert(1)"])
def test_login_never_sends_the_browser_off_the_site(sqlite_env: Env, target: str) -> None:
    browser = sqlite_env.app.test_client()
    done = login(browser, sqlite_env.token, target)
    assert done.status_code == 303 and done.headers["Location"] == "/", done.headers.get("Location")


def test_login_returns_to_a_page_of_the_site_with_its_query(sqlite_env: Env) -> None:
    done = login(sqlite_env.app.test_client(), sqlite_env.token, "/builds/7?x=1")
    assert done.status_code == 303 and done.headers["Location"] == "/builds/7?x=1"


def test_open_reads_and_private_metrics(make_env: EnvFactory, sqlite_url: str) -> None:
    open_env = make_env(sqlite_url, open_reads=True)
    anonymous = open_env.app.test_client()
    assert anonymous.get("/v1/builds").status_code == 200
    assert anonymous.get("/").status_code == 200
    assert anonymous.get("/v1/workers").status_code == 200
    assert_problem(anonymous.post("/v1/builds", json={}), 401, "unauthorized")  # writes still need a token
    assert_problem(anonymous.get("/v1/tokens"), 401)
    # A token is optional there, but one that is sent must be valid: a mistyped or revoked one is told so.
    assert open_env.client.get("/v1/builds").status_code == 200
    assert_problem(anonymous.get("/v1/builds", headers=bearer("csvc_not-a-token")), 401, "unauthorized")
    assert anonymous.get("/healthz", headers=bearer("csvc_not-a-token")).status_code == 200  # public: unread

    closed = make_env(sqlite_url, public_metrics=False)
    assert_problem(closed.app.test_client().get("/metrics"), 401, "unauthorized")
    assert closed.client.get("/metrics").status_code == 200


def test_the_document_says_what_open_reads_and_private_metrics_do(make_env: EnvFactory, sqlite_url: str) -> None:
    """Found by the conformance fuzz run under these settings: the document said GET /v1/builds needs a
    token while open reads served it without one, and documented no 401 for a private /metrics. Its security
    now follows the settings the server enforces."""
    def operation(env: Env, method: str, path: str) -> dict[str, Any]:
        return env.app.test_client().get("/openapi.json").json["paths"][path][method]  # type: ignore[no-any-return]

    env = make_env(sqlite_url, open_reads=True, public_metrics=False)
    anonymous = env.app.test_client()
    assert anonymous.get("/v1/builds").status_code == 200
    builds = operation(env, "get", "/v1/builds")
    assert {} in builds["security"] and "401" in builds["responses"] and "403" not in builds["responses"]
    assert_problem(anonymous.get("/metrics"), 401, "unauthorized")
    metrics = operation(env, "get", "/metrics")
    assert {} not in metrics["security"] and {"401", "403"} <= set(metrics["responses"])
    assert {} not in operation(env, "post", "/v1/builds")["security"]  # writes still need a token

    default = make_env(sqlite_url)
    assert {} not in operation(default, "get", "/v1/builds")["security"]
    assert {} in operation(default, "get", "/metrics")["security"]


def test_a_token_expiry_is_read_as_its_schema_says(sqlite_env: Env) -> None:
    """Kin of a conformance fuzz finding (POST /v1/campaigns/rollforward): lax validation read "3600" and true
    as integers; the document says an integer, and 3600.0 is one."""
    body = {"name": "ci", "owner": "pipeline", "scopes": ["read"]}
    for value in ("3600", True):
        response = sqlite_env.client.post("/v1/tokens", json={**body, "expires_in_seconds": value})
        assert assert_problem(response, 422, "token-invalid")["errors"][0]["field"] == "expires_in_seconds"
    assert sqlite_env.client.post("/v1/tokens", json={**body, "expires_in_seconds": 3600.0}).status_code == 201


def test_tokens_api_shows_a_secret_once_and_keeps_its_hash(env: Env) -> None:
    made = env.client.post("/v1/tokens", json={"name": "ci", "owner": "pipeline", "team": "vision",
                                               "scopes": ["submit"], "expires_in_seconds": 3600})
    assert made.status_code == 201, made.get_data(as_text=True)
    body = made.json
    secret = body["token"]
    assert secret.startswith("csvc_") and len(secret) >= 40 and body["hint"] == secret[:9]
    assert body["created_by"] == "web-tests" and body["expires_at"] is not None
    with env.services.sessions() as session:
        row = session.get(ApiToken, body["id"])
        assert row is not None and row.token_hash == token_hash(secret)
        stored = {str(value) for value in vars(row).values()}
    assert secret not in stored
    listed = env.client.get("/v1/tokens").json["items"]
    assert [t["name"] for t in listed] == ["test token", "ci"] or "ci" in [t["name"] for t in listed]
    assert all("token" not in t for t in listed)
    assert env.app.test_client().get("/v1/builds", headers=bearer(secret)).status_code == 200
    with env.services.sessions() as session:
        assert session.get_one(ApiToken, body["id"]).last_used_at is not None

    revoked = env.client.post(f"/v1/tokens/{body['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json["revoked_at"] is not None
    again = env.client.post(f"/v1/tokens/{body['id']}/revoke")
    assert again.json["revoked_at"] == revoked.json["revoked_at"]
    assert env.app.test_client().get("/v1/builds", headers=bearer(secret)).status_code == 401
    assert body["id"] not in [t["id"] for t in env.client.get("/v1/tokens").json["items"]]
    assert body["id"] in [t["id"] for t in env.client.get("/v1/tokens?all=true").json["items"]]
    assert_problem(env.client.post("/v1/tokens/424242/revoke"), 404, "token-not-found")

    for bad in ({"name": "x", "owner": "o", "scopes": ["fleet", "read"]}, {"name": "x", "owner": "o", "scopes": []},
                {"name": "x", "owner": "o", "scopes": ["root"]}, {"name": "", "owner": "o", "scopes": ["read"]},
                {"name": "x", "owner": " padded", "scopes": ["read"]}, {"name": "x", "owner": "o", "scopes": ["read"],
                                                                         "expires_in_seconds": 5}):
        assert_problem(env.client.post("/v1/tokens", json=bad), 422, "token-invalid")


def test_a_checked_token_is_trusted_for_the_cache_time_only(make_env: EnvFactory, sqlite_url: str) -> None:
    cached = make_env(sqlite_url, token_cache_seconds=3600)
    uncached = make_env(sqlite_url, token_cache_seconds=0)
    for env in (cached, uncached):
        token = make_token(env.services.sessions, "read")
        assert env.app.test_client().get("/v1/builds", headers=bearer(token)).status_code == 200
        with transaction(env.services.sessions) as session:  # revoked by another process
            session.execute(update(ApiToken).where(ApiToken.token_hash == token_hash(token))
                            .values(revoked_at=utcnow()))
        status = env.app.test_client().get("/v1/builds", headers=bearer(token)).status_code
        assert status == (200 if env is cached else 401)


def test_the_bootstrap_token_is_registered_once_and_stays_revoked(make_env: EnvFactory, sqlite_url: str) -> None:
    secret = "csvc_operator-chosen-bootstrap-0123456789"
    env = make_env(sqlite_url, bootstrap_token=secret, with_token=False)
    client = env.app.test_client()
    made = client.post("/v1/tokens", json={"name": "ops", "owner": "alice", "scopes": ["admin"]},
                       headers=bearer(secret))
    assert made.status_code == 201
    with env.services.sessions() as session:
        boot = session.scalars(select(ApiToken).where(ApiToken.name == "bootstrap")).one()
    assert client.post(f"/v1/tokens/{boot.id}/revoke", headers=bearer(made.json["token"])).status_code == 200
    again = make_env(sqlite_url, bootstrap_token=secret, with_token=False)  # the API restarts with it still set
    assert again.app.test_client().get("/v1/builds", headers=bearer(secret)).status_code == 401
    with pytest.raises(ValueError, match="COMPILESVC_BOOTSTRAP_TOKEN"):
        make_env(sqlite_url, bootstrap_token="too-short", with_token=False)
