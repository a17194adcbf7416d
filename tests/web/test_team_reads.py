"""The team boundary for reads (``COMPILESVC_TEAM_READS``, docs/security.md): two teams' tokens against the
real app and ledgers. Every endpoint the ``read`` scope opens, as docs/security.md's endpoint table lists
them, is called with one team's tokens and the other team's ids, and must answer as for things that do not
exist; lists, pages and counts hold the reader's own builds; admins see everything; with the setting off
nothing changes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
from flask.testing import FlaskClient
from pydantic import ValidationError
from sqlalchemy import update
from werkzeug.test import TestResponse

from compilesvc.access.team_reads import EVERYTHING, Reader
from compilesvc.compiles import leases
from compilesvc.config.settings import Settings
from compilesvc.dispatch import registry
from compilesvc.insights.stats import Stats, collect
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Build
from tests.fixtures.s3server import S3Server
from tests.fixtures.tokens import bearer, make_token
from tests.web.conftest import EnvFactory
from tests.web.support import WORKER, Env, add_log_lines, complete_build, fail_build, queued_buckets, spec_for
from tests.web.test_auth import login, matrix

#: Endpoints of the table the read scope opens that take no part here, and why.
NOT_TEAM_DATA = {
    ("GET", "/v1/blobs/{sha256}"): "a signed URL is its own credential; the URLs are what is checked",
    ("POST", "/login"): "the login form, not a read",
    ("POST", "/logout"): "not a read",
}


@dataclass
class World:
    """Two teams' builds in one ledger: vision's private artifact and failed build, nlp's own artifact and a
    build in flight, one artifact both teams built (dedupe), and a build from before teams existed."""

    env: Env
    tokens: dict[str, str]
    vision_private: dict[str, Any]  # a published build of vision's own model
    vision_failed: int
    shared_vision: dict[str, Any]  # vision's build of the shared artifact (nlp's is a hit of it)
    shared_nlp: dict[str, Any]
    nlp_own: dict[str, Any]
    nlp_building: int
    legacy: int  # no team


def _submit(env: Env, spec: dict[str, Any], token: str) -> dict[str, Any]:
    response = env.submit(spec, Authorization=f"Bearer {token}")
    assert response.status_code in (200, 202), response.get_data(as_text=True)
    return response.json  # type: ignore[no-any-return]


def make_world(env: Env) -> World:
    sessions = env.services.sessions
    tokens = {f"{team}-{scope}": make_token(sessions, scope, owner=f"{team}-{scope}", team=team)
              for team in ("vision", "nlp") for scope in ("fleet", "read", "submit")}
    private = _submit(env, spec_for(env.upload(b"vision private model"), name="vision-private",
                                    labels={"project": "vision-secret-label"}), tokens["vision-submit"])
    complete_build(env.services, private["build_id"])
    failed = _submit(env, spec_for(env.upload(b"vision broken model"), name="vision-broken"),
                     tokens["vision-submit"])
    fail_build(env.services, failed["build_id"], message="vision-secret-failure")
    shared_spec = spec_for(env.upload(b"a model both teams use"), name="shared-model")
    shared_vision = _submit(env, shared_spec, tokens["vision-submit"])
    complete_build(env.services, shared_vision["build_id"])
    shared_nlp = _submit(env, shared_spec, tokens["nlp-submit"])
    assert shared_nlp["outcome"] == "hit"
    nlp_own = _submit(env, spec_for(env.upload(b"nlp model"), name="nlp-model"), tokens["nlp-submit"])
    complete_build(env.services, nlp_own["build_id"])
    building = _submit(env, spec_for(env.upload(b"nlp second model"), name="nlp-second"), tokens["nlp-submit"])
    add_log_lines(env.services, building["build_id"], ["nlp line"])
    legacy = _submit(env, spec_for(env.upload(b"an old model"), name="legacy-model"), env.token)
    with transaction(sessions) as session:
        session.execute(update(Build).where(Build.id == legacy["build_id"]).values(team=None, token_id=None))
    for kind, value in (("model", "vision-private"), ("label", "project:vision-secret-label"),
                        ("artifact", private["artifact_key"]), ("model", "nlp-model")):
        assert env.client.post("/v1/pins", json={"kind": kind, "value": value}).status_code == 201
    campaign = env.client.post("/v1/campaigns/rollforward", json={"from_sdk": "2.13.0", "to_sdk": "2.14.0"})
    assert campaign.status_code == 201, campaign.get_data(as_text=True)
    return World(env, tokens, private, failed["build_id"], shared_vision, shared_nlp, nlp_own,
                 building["build_id"], legacy["build_id"])


@pytest.fixture
def world(make_env: EnvFactory, ledger_url: str) -> World:
    return make_world(make_env(ledger_url, team_reads=True,
                               config={"SSE_MAX_SECONDS": 0.2, "SSE_POLL_SECONDS": 0.05}))


def vision_marks(world: World) -> list[str]:
    """What of vision's own data nlp must never read: keys, model digests and names, a label, an error."""
    private = world.env.client.get(f"/v1/builds/{world.vision_private['build_id']}").json
    assert private is not None
    return [private["artifact_key"], private["model_sha256"], "vision-private", "vision-secret-label",
            "vision-broken", "vision-secret-failure", "vision-submit", "legacy-model"]


def vision_build_ids(world: World) -> list[int]:
    return [world.vision_private["build_id"], world.vision_failed, world.shared_vision["build_id"], world.legacy]


def leaks(text: str, marks: list[str], build_ids: list[int]) -> list[str]:
    found = [mark for mark in marks if mark in text]
    for build_id in build_ids:
        pattern = rf'(builds/{build_id}\b|"(build_id|from_build|again_by)":\s*{build_id}\b|build {build_id}\b)'
        if re.search(pattern, text):
            found.append(f"build {build_id}")
    return found


def read_rows() -> list[tuple[str, str]]:
    """Every endpoint of the table that a read token may call (the table is the list, so that an endpoint
    added to it is checked here without anyone remembering to)."""
    return sorted(row for row, columns in matrix().items()
                  if columns["read"] == "ok" and row not in NOT_TEAM_DATA)


def read(client: FlaskClient, method: str, path: str, fill: dict[str, Any], token: str) -> TestResponse:
    """The whole answer (a log stream ends within SSE_MAX_SECONDS)."""
    return client.open(path.format(**fill["path"]), method=method, headers=bearer(token),
                       json=fill["bodies"].get((method, path)))


def test_another_teams_data_never_reaches_a_read_token_on_any_endpoint(world: World) -> None:
    env = world.env
    marks = vision_marks(world)
    fill: dict[str, Any] = {"path": {"key": world.vision_private["artifact_key"], "id": world.vision_failed,
                     "code": "unauthorized", "filename": "style.css", "sha256": ""},
            "bodies": {("POST", "/v1/artifacts/resolve"): env.client.get(
                f"/v1/builds/{world.vision_private['build_id']}").json["spec"]}}  # type: ignore[index]
    problems = []
    for method, path in read_rows():
        for token_name in ("nlp-read", "nlp-submit", "nlp-fleet"):
            for build_id in vision_build_ids(world):
                fill["path"]["id"] = build_id
                response = read(env.app.test_client(), method, path, fill, world.tokens[token_name])
                if response.status_code in (401, 403):
                    continue  # refused by scope (the matrix test checks those)
                text = response.get_data(as_text=True)
                # A 404 names the id or key asked for, and resolve the key and digest of the spec sent:
                # echoes of the request, not the other team's data.
                body = fill["bodies"].get((method, path))
                # (a spec's key is a function of the spec: whoever sends the spec can compute it)
                sent = path.format(**fill["path"]) + (json.dumps(body) + marks[0] if body else "")
                asked = [b for b in vision_build_ids(world) if response.status_code != 404 or b != build_id]
                found = leaks(text, [mark for mark in marks if mark not in sent], asked)
                if found:
                    problems.append(f"{method} {path} as {token_name} (build {build_id}): {found}")
                if ("{id}" in path or "{key}" in path) and response.status_code != 404:
                    problems.append(f"{method} {path} as {token_name}: {response.status_code}, not 404")
                if "{id}" not in path:
                    break  # the other ids would ask the same
    assert not problems, "\n".join(problems)


def test_another_teams_build_answers_exactly_as_a_missing_one(world: World) -> None:
    client, nlp = world.env.app.test_client(), bearer(world.tokens["nlp-read"])
    for suffix in ("", "/logs", "/miss", "/webhooks", "/logs/stream"):
        theirs = client.get(f"/v1/builds/{world.vision_private['build_id']}{suffix}", headers=nlp)
        missing = client.get(f"/v1/builds/987654{suffix}", headers=nlp)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json["type"] == missing.json["type"] == "/problems/build-not-found"  # type: ignore[index]
    key = world.vision_private["artifact_key"]
    theirs = client.get(f"/v1/artifacts/{key}", headers=bearer(world.tokens["nlp-fleet"]))
    body = theirs.json
    assert theirs.status_code == 404 and body is not None
    assert (body["type"], body["detail"]) == ("/problems/artifact-not-found", f"no artifact has key {key}")
    # Cancel and retry by another team's submitter: 404 too (403 would confirm the build exists).
    for action in ("cancel", "retry"):
        refused = client.post(f"/v1/builds/{world.vision_failed}/{action}", headers=bearer(world.tokens["nlp-submit"]))
        assert refused.status_code == 404, refused.get_data(as_text=True)


def test_each_team_reads_its_own_builds_pages_and_shared_artifacts(world: World) -> None:
    client = world.env.app.test_client()
    nlp, vision = bearer(world.tokens["nlp-read"]), bearer(world.tokens["vision-read"])
    nlp_ids = {world.shared_nlp["build_id"], world.nlp_own["build_id"], world.nlp_building}
    seen, url = [], "/v1/builds?limit=1"
    while url:  # one build a page: pages and cursors count nlp's builds only
        page = client.get(url.removeprefix("http://api.test"), headers=nlp).json
        assert page is not None
        seen += [item["build_id"] for item in page["items"]]
        url = page["next"]
    assert sorted(seen) == sorted(nlp_ids)
    vision_seen = {b["build_id"] for b in client.get("/v1/builds", headers=vision).json["items"]}  # type: ignore[index]
    assert vision_seen == {world.vision_private["build_id"], world.vision_failed, world.shared_vision["build_id"]}
    admin_seen = {b["build_id"] for b in world.env.client.get("/v1/builds").json["items"]}  # type: ignore[index]
    assert admin_seen == nlp_ids | vision_seen | {world.legacy}
    # The shared artifact: both teams fetch it; nlp's hit names no vision build as where it came from.
    key = world.shared_nlp["artifact_key"]
    for token in ("nlp-fleet", "vision-fleet", "nlp-read"):
        assert client.get(f"/v1/artifacts/{key}", headers=bearer(world.tokens[token])).status_code == 200
    hit = client.get(f"/v1/builds/{world.shared_nlp['build_id']}", headers=nlp).json
    assert hit is not None and hit["artifact"] is not None
    assert {b["origin"]["from_build"] for b in hit["buckets"]} == {None}
    admin_hit = world.env.client.get(f"/v1/builds/{world.shared_nlp['build_id']}").json
    assert {b["origin"]["from_build"] for b in admin_hit["buckets"]} == {world.shared_vision["build_id"]}  # type: ignore[index]
    # Resolve: vision's private spec is "absent" for nlp, published for vision.
    spec = world.env.client.get(f"/v1/builds/{world.vision_private['build_id']}").json["spec"]  # type: ignore[index]
    as_nlp = client.post("/v1/artifacts/resolve", json=spec, headers=nlp).json
    assert as_nlp is not None and as_nlp["state"] == "absent" and as_nlp["artifact"] is None
    assert {b["state"] for b in as_nlp["buckets"]} == {"absent"}
    assert client.post("/v1/artifacts/resolve", json=spec, headers=vision).json["state"] == "published"  # type: ignore[index]
    # Download URLs only for what the team may read: nlp's answers carry none of vision's private files.
    private_files = client.get(f"/v1/artifacts/{world.vision_private['artifact_key']}", headers=vision).json
    sha = private_files["buckets"][0]["files"][0]["sha256"]  # type: ignore[index]
    for build in (world.shared_nlp, world.nlp_own):
        assert sha not in client.get(f"/v1/builds/{build['build_id']}", headers=nlp).get_data(as_text=True)


def test_builds_without_a_team_are_read_by_admins_only(world: World) -> None:
    client = world.env.app.test_client()
    for token in ("nlp-read", "vision-read", "vision-submit"):
        assert client.get(f"/v1/builds/{world.legacy}", headers=bearer(world.tokens[token])).status_code == 404
        assert client.get(f"/builds/{world.legacy}", headers=bearer(world.tokens[token])).status_code == 404
    assert world.env.client.get(f"/v1/builds/{world.legacy}").status_code == 200


def test_admins_read_every_teams_builds_logs_and_artifacts(world: World) -> None:
    admin = world.env.client
    for build_id in [*vision_build_ids(world), world.nlp_building]:
        for suffix in ("", "/logs", "/miss", "/webhooks"):
            assert admin.get(f"/v1/builds/{build_id}{suffix}").status_code == 200
        assert admin.get(f"/builds/{build_id}").status_code == 200
    assert admin.get(f"/v1/artifacts/{world.vision_private['artifact_key']}").status_code == 200
    assert "vision-private" in admin.get("/artifacts").get_data(as_text=True)
    assert "nlp-model" in admin.get("/artifacts").get_data(as_text=True)


def test_ui_pages_show_a_team_its_own(world: World) -> None:
    client = world.env.app.test_client()
    nlp = bearer(world.tokens["nlp-read"])
    history = client.get("/", headers=nlp).get_data(as_text=True)
    assert "nlp-model" in history and "vision-private" not in history
    counts = dict(re.findall(r'class="badge state-\w+"[^>]*>(\w+): (\d+)', history))
    assert counts["failed"] == "0" and counts["succeeded"] == "2" and counts["building"] == "1", counts
    artifacts = client.get("/artifacts", headers=nlp).get_data(as_text=True)
    assert "nlp-model" in artifacts and "shared-model" in artifacts and "vision-private" not in artifacts
    stats = client.get("/stats?window=day", headers=nlp)
    assert stats.status_code == 200 and "vision-private" not in stats.get_data(as_text=True)
    page = client.get(f"/builds/{world.shared_nlp['build_id']}", headers=nlp).get_data(as_text=True)
    assert f"/builds/{world.shared_vision['build_id']}\"" not in page
    assert client.get(f"/builds/{world.vision_private['build_id']}/log.txt", headers=nlp).status_code == 404


def test_with_the_setting_off_every_read_token_reads_everything(make_env: EnvFactory, sqlite_url: str) -> None:
    world = make_world(make_env(sqlite_url))
    client, nlp = world.env.app.test_client(), bearer(world.tokens["nlp-read"])
    for build_id in vision_build_ids(world):
        assert client.get(f"/v1/builds/{build_id}", headers=nlp).status_code == 200
    listed = {b["build_id"] for b in client.get("/v1/builds", headers=nlp).json["items"]}  # type: ignore[index]
    assert set(vision_build_ids(world)) <= listed
    key = world.vision_private["artifact_key"]
    assert client.get(f"/v1/artifacts/{key}", headers=bearer(world.tokens["nlp-fleet"])).status_code == 200
    assert "vision-private" in client.get("/artifacts", headers=nlp).get_data(as_text=True)


def test_team_reads_and_open_reads_are_refused_together(tmp_path: Any) -> None:
    with pytest.raises(ValidationError, match=r"team_reads and open_reads .* contradict"):
        Settings(team_reads=True, open_reads=True, data_dir=tmp_path)


def test_statistics_count_what_the_team_may_read(world: World) -> None:
    def of(team: str | None) -> Stats:
        reader = Reader(bounded=True, team=team) if team else EVERYTHING
        with world.env.services.sessions() as session:
            return collect(session, "day", reader=reader)

    nlp, vision, everyone, nobody = of("nlp"), of("vision"), of(None), Reader(bounded=True)
    assert sum(b.total for b in nlp.outcomes) == 3 and sum(b.total for b in vision.outcomes) == 3
    assert sum(b.total for b in everyone.outcomes) == 7
    assert (sum(f.total for f in nlp.failures), sum(f.total for f in vision.failures)) == (0, 1)
    assert {c.model_name for c in nlp.compile_times} == {"shared-model", "nlp-model"}
    assert {c.model_name for c in vision.compile_times} == {"shared-model", "vision-private"}
    with world.env.services.sessions() as session:
        assert sum(b.total for b in collect(session, "day", reader=nobody).outcomes) == 0


def test_a_team_reads_an_artifact_from_its_first_build_of_it(world: World) -> None:
    client, fleet = world.env.app.test_client(), bearer(world.tokens["vision-fleet"])
    key = world.nlp_own["artifact_key"]
    assert client.get(f"/v1/artifacts/{key}", headers=fleet).status_code == 404
    spec = world.env.client.get(f"/v1/builds/{world.nlp_own['build_id']}").json["spec"]  # type: ignore[index]
    assert _submit(world.env, spec, world.tokens["vision-submit"])["outcome"] == "hit"
    assert client.get(f"/v1/artifacts/{key}", headers=fleet).status_code == 200  # no "absent" remembered
    nlp_view = client.get("/v1/builds", headers=bearer(world.tokens["nlp-read"])).json
    assert len(nlp_view["items"]) == 3  # type: ignore[index]  # vision's hit is not nlp's to see


def test_a_shared_artifacts_events_name_no_other_teams_build(world: World) -> None:
    spec = world.env.client.get(f"/v1/builds/{world.nlp_building}").json["spec"]  # type: ignore[index]
    joined = _submit(world.env, spec, world.tokens["vision-submit"])
    assert joined["outcome"] == "join"
    fail_build(world.env.services, world.nlp_building)
    nlp = bearer(world.tokens["nlp-submit"])
    assert world.env.app.test_client().post(f"/v1/builds/{world.nlp_building}/retry", headers=nlp).status_code == 202
    client = world.env.app.test_client()
    for who, build_id, other in (("vision-read", joined["build_id"], world.nlp_building),
                                 ("nlp-read", world.nlp_building, joined["build_id"])):
        text = client.get(f"/v1/builds/{build_id}", headers=bearer(world.tokens[who])).get_data(as_text=True)
        assert not leaks(text, [], [other]), (who, text)
        page = client.get(f"/builds/{build_id}", headers=bearer(world.tokens[who])).get_data(as_text=True)
        assert not leaks(page, [], [other]), who
    admin = world.env.client.get(f"/v1/builds/{joined['build_id']}").get_data(as_text=True)
    assert leaks(admin, [], [world.nlp_building])  # the admin reads the retry's reason


def test_a_browser_session_reads_as_its_token_and_a_team_reads_its_own_logs(world: World) -> None:
    browser = world.env.app.test_client()
    login(browser, world.tokens["nlp-read"])
    assert "nlp-model" in browser.get("/").get_data(as_text=True)
    assert browser.get(f"/builds/{world.vision_private['build_id']}").status_code == 404
    assert browser.get(f"/builds/{world.nlp_building}").status_code == 200
    nlp = bearer(world.tokens["nlp-read"])
    client = world.env.app.test_client()
    logs = client.get(f"/v1/builds/{world.nlp_building}/logs", headers=nlp).json
    assert logs is not None and [line["line"] for line in logs["lines"]] == ["nlp line"]
    stream = client.get(f"/v1/builds/{world.nlp_building}/logs/stream", headers=nlp)
    assert stream.status_code == 200 and "nlp line" in stream.get_data(as_text=True)


def test_the_workers_page_shows_a_team_only_its_running_compiles(world: World) -> None:
    spec = world.env.client.get(f"/v1/builds/{world.nlp_building}").json["spec"]  # type: ignore[index]
    joined = _submit(world.env, spec, world.tokens["vision-submit"])  # the compile is now vision's too
    running = queued_buckets(world.env.services, world.nlp_building)
    private = _submit(world.env, spec_for(world.env.upload(b"vision's next model"), name="vision-next"),
                      world.tokens["vision-submit"])
    running += queued_buckets(world.env.services, private["build_id"])
    with transaction(world.env.services.sessions) as session:
        registry.register(session, WORKER, "host", {}, ["cpu"], 4)
        for bucket_id in running:
            assert leases.claim(session, bucket_id, WORKER, lease_seconds=60) is not None
    client = world.env.app.test_client()
    nlp = client.get("/workers", headers=bearer(world.tokens["nlp-read"])).get_data(as_text=True)
    assert f"build {world.nlp_building}" in nlp and not leaks(nlp, [], [private["build_id"], joined["build_id"]])
    vision = client.get("/workers", headers=bearer(world.tokens["vision-read"])).get_data(as_text=True)
    assert f"build {private['build_id']}" in vision and not leaks(vision, [], [world.nlp_building])
    assert re.search(r"compile \d+", vision)  # the shared compile, queued by nlp's build, is shown without it
    admin = world.env.client.get("/workers").get_data(as_text=True)
    assert f"build {world.nlp_building}" in admin and f"build {private['build_id']}" in admin


def test_on_an_s3_store_only_the_team_gets_download_urls(make_env: EnvFactory, sqlite_url: str,
                                                         s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    env = make_env(sqlite_url, team_reads=True, store_url=f"s3://{s3_server.new_bucket('teams')}/artifacts",
                   s3_endpoint_url=s3_server.endpoint_url)
    world = make_world(env)
    key, client = world.vision_private["artifact_key"], env.app.test_client()
    assert client.get(f"/v1/artifacts/{key}", headers=bearer(world.tokens["nlp-fleet"])).status_code == 404
    answer = client.get(f"/v1/artifacts/{key}", headers=bearer(world.tokens["vision-fleet"])).json
    assert answer is not None
    url = answer["buckets"][0]["files"][0]["url"]
    assert url.startswith(s3_server.endpoint_url) and "Signature" in url


def test_an_upload_answers_alike_whether_or_not_another_team_holds_the_bytes(make_env: EnvFactory,
                                                                             sqlite_url: str) -> None:
    env = make_env(sqlite_url, team_reads=True)
    vision = bearer(make_token(env.services.sessions, "submit", team="vision"))
    nlp = bearer(make_token(env.services.sessions, "submit", team="nlp"))

    def upload(data: bytes, headers: dict[str, str]) -> dict[str, Any]:
        answer = env.client.post("/v1/models", data=data, content_type="application/octet-stream", headers=headers)
        assert answer.status_code == 201, answer.get_data(as_text=True)
        return dict(answer.json)  # type: ignore[arg-type]

    held = upload(b"vision's private model", vision)
    assert held["created"] is True
    theirs = upload(b"vision's private model", nlp)
    fresh = upload(b"nlp's own model", nlp)
    assert theirs.keys() == fresh.keys() and theirs["created"] is fresh["created"] is True
    # An admin (no boundary) still learns what the store holds.
    assert upload(b"vision's private model", {})["created"] is False
