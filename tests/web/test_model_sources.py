"""Which S3 models a team may name (``COMPILESVC_MODEL_S3_PREFIXES``, docs/security.md "Model sources"): two teams'
tokens against the real API and a real S3 server (weed), each naming its own models (allowed) and the other's
(refused, 422 on ``model.uri``, before any S3 request: the answer is the same whether the object exists), with the
tricks a prefix match must survive (a longer bucket name, a longer key, ``..`` and encoded dots), for submits,
resolves, admins, requests without a token, and roll-forward campaigns (checked against the source build's team)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from compilesvc.builds.policy_submits import policy_submit
from compilesvc.builds.submit import Submitter
from compilesvc.ledger.campaigns import CampaignItem
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Build
from compilesvc.lifecycle import campaigns
from tests.fixtures.ports import free_port
from tests.fixtures.s3server import S3Server
from tests.fixtures.tokens import bearer, make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem

SETTING = "COMPILESVC_MODEL_S3_PREFIXES"


class World:
    """Buckets: vision's own; one whose name continues vision's; a shared one where nlp owns ``nlp`` (a key prefix
    without "/") and not ``nlp-private``; a public one every team may read. Each holds a model."""

    def __init__(self, s3: S3Server):
        raw = s3.raw_client()
        self.vision = s3.new_bucket("vision")
        self.vision_longer = self.vision + "x"  # "s3://vision-…" must not cover "s3://vision-…x"
        raw.create_bucket(Bucket=self.vision_longer)
        self.shared = s3.new_bucket("shared")
        self.public = s3.new_bucket("public")
        for bucket, key in ((self.vision, "resnet/model.pt"), (self.vision_longer, "resnet/model.pt"),
                            (self.shared, "nlp/bert.pt"), (self.shared, "nlp-private/bert.pt"),
                            (self.public, "tiny.pt")):
            raw.put_object(Bucket=bucket, Key=key, Body=f"a model in {bucket}/{key}".encode())

    def setting(self) -> dict[str, list[str]]:
        return {"vision": [f"s3://{self.vision}"], "nlp": [f"s3://{self.shared}/nlp"], "*": [f"s3://{self.public}/"]}


@pytest.fixture
def world(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> World:
    s3_server.use_as_credential_chain(monkeypatch)
    return World(s3_server)


def s3_env(make_env: EnvFactory, database_url: str, s3: S3Server, prefixes: dict[str, list[str]] | None,
           **overrides: Any) -> Env:
    settings: dict[str, Any] = {"s3_endpoint_url": s3.endpoint_url, "s3_region": s3.region, **overrides}
    if prefixes is not None:
        settings["model_s3_prefixes"] = prefixes
    return make_env(database_url, **settings)


@pytest.fixture
def env(make_env: EnvFactory, sqlite_url: str, s3_server: S3Server, world: World) -> Env:
    return s3_env(make_env, sqlite_url, s3_server, world.setting())


def tokens(env: Env, *scopes: str) -> dict[str, str]:
    return {team: make_token(env.services.sessions, *scopes, owner=f"{team}-ci", team=team)
            for team in ("vision", "nlp")}


def submit(env: Env, uri: str, token: str, **spec: Any) -> Any:
    return env.client.post("/v1/builds?queue_anyway=true", json=spec_for(uri, **spec), headers=bearer(token))


def refused(response: Any, team: str | None, uri: str) -> str:
    body = assert_problem(response, 422, "model-ref-invalid")
    who = f"team {team!r}" if team else "a request without a team"
    assert body["errors"][0]["field"] == "model.uri", body
    assert who in body["detail"] and f"may not read {uri}" in body["detail"], body
    return str(body["detail"])


def test_each_team_names_its_own_and_the_shared_models(env: Env, world: World) -> None:
    token = tokens(env, "submit")
    for team, uri in (("vision", f"s3://{world.vision}/resnet/model.pt"), ("nlp", f"s3://{world.shared}/nlp/bert.pt"),
                      ("vision", f"s3://{world.public}/tiny.pt"), ("nlp", f"s3://{world.public}/tiny.pt")):
        response = submit(env, uri, token[team])
        assert response.status_code in (200, 202), (team, uri, response.get_data(as_text=True))
        with env.services.sessions() as session:
            assert session.get_one(Build, response.json["build_id"]).team == team


def test_a_team_naming_another_teams_models_is_refused_whether_they_exist_or_not(env: Env, world: World) -> None:
    token = tokens(env, "submit")
    attacks = [
        ("vision", f"s3://{world.shared}/nlp/bert.pt"),                # nlp's object
        ("nlp", f"s3://{world.vision}/resnet/model.pt"),               # vision's bucket
        ("vision", f"s3://{world.vision_longer}/resnet/model.pt"),     # a bucket whose name continues vision's
        ("nlp", f"s3://{world.shared}/nlp-private/bert.pt"),           # a key that continues nlp's prefix
        ("nlp", f"s3://{world.shared}/nlp/../nlp-private/bert.pt"),    # dot segments a proxy may resolve
        ("nlp", f"s3://{world.shared}/nlp/%2e%2e/nlp-private/bert.pt"),
        ("nlp", f"s3://{world.shared}/nlp/..%5cnlp-private/bert.pt"),
    ]
    for team, uri in attacks:
        detail = refused(submit(env, uri, token[team]), team, uri)
        if ".." not in uri and "%2e" not in uri:
            assert SETTING in detail, detail
    # No existence oracle: a missing object, a missing bucket and an existing object answer alike.
    answers = set()
    for uri in (f"s3://{world.shared}/nlp-private/bert.pt", f"s3://{world.shared}/nlp-private/nothing.pt",
                "s3://no-such-bucket-at-all/nlp-private/bert.pt"):
        body = assert_problem(submit(env, uri, token["nlp"]), 422)
        answers.add(body["detail"].replace(uri, "URI"))
    assert len(answers) == 1, answers
    with env.services.sessions() as session:
        assert session.scalar(select(Build.id).where(Build.team.in_(["vision", "nlp"]))) is None  # nothing built


def test_a_checkpoint_prefix_of_another_team_is_refused_before_it_is_listed(env: Env, world: World) -> None:
    token = tokens(env, "submit")
    uri = f"s3://{world.vision}/llama/"
    document = {"model": {"uri": uri, "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.0",
                "neuron_config": {"tp_degree": 8, "seq_len": 128}}
    response = env.client.post("/v1/builds?queue_anyway=true", json=document, headers=bearer(token["nlp"]))
    refused(response, "nlp", uri)


def test_the_check_makes_no_s3_request(make_env: EnvFactory, sqlite_url: str, s3_server: S3Server,
                                       world: World) -> None:
    """With S3 unreachable, a refused URI is still a 422 (it was never asked for) and an allowed one a 503."""
    env = s3_env(make_env, sqlite_url, s3_server, world.setting(),
                 s3_endpoint_url=f"http://127.0.0.1:{free_port()}")
    fleet = tokens(env, "fleet")
    theirs, own = f"s3://{world.vision}/resnet/model.pt", f"s3://{world.shared}/nlp/bert.pt"
    resolve = env.client.post("/v1/artifacts/resolve", json=spec_for(theirs), headers=bearer(fleet["nlp"]))
    refused(resolve, "nlp", theirs)
    assert_problem(env.client.post("/v1/artifacts/resolve", json=spec_for(own), headers=bearer(fleet["nlp"])), 503)


def test_a_fleet_token_resolves_only_its_teams_models(env: Env, world: World) -> None:
    fleet = tokens(env, "fleet")
    own = env.client.post("/v1/artifacts/resolve", json=spec_for(f"s3://{world.vision}/resnet/model.pt"),
                          headers=bearer(fleet["vision"]))
    assert own.status_code == 200 and own.json["model"]["sha256"], own.get_data(as_text=True)
    theirs = f"s3://{world.vision}/resnet/model.pt"
    refused(env.client.post("/v1/artifacts/resolve", json=spec_for(theirs), headers=bearer(fleet["nlp"])), "nlp",
            theirs)


def test_admins_are_bounded_by_their_team_and_requests_without_a_token_by_every_teams(
        make_env: EnvFactory, sqlite_url: str, s3_server: S3Server, world: World) -> None:
    env = s3_env(make_env, sqlite_url, s3_server, world.setting(), open_reads=True)
    admin = make_token(env.services.sessions, "admin", owner="ops", team="ops")
    vision = f"s3://{world.vision}/resnet/model.pt"
    refused(submit(env, vision, admin), "ops", vision)
    assert submit(env, f"s3://{world.public}/tiny.pt", admin).status_code in (200, 202)
    anonymous = env.app.test_client()  # open reads: resolve needs no token
    refused(anonymous.post("/v1/artifacts/resolve", json=spec_for(vision)), None, vision)
    assert anonymous.post("/v1/artifacts/resolve", json=spec_for(f"s3://{world.public}/tiny.pt")).status_code == 200


def test_with_the_setting_unset_no_team_names_an_s3_model(make_env: EnvFactory, sqlite_url: str,
                                                          s3_server: S3Server, world: World) -> None:
    env = s3_env(make_env, sqlite_url, s3_server, None)
    token = tokens(env, "submit")
    for uri in (f"s3://{world.vision}/resnet/model.pt", f"s3://{world.public}/tiny.pt"):
        assert SETTING in refused(submit(env, uri, token["vision"]), "vision", uri)
    assert submit(env, env.upload(), token["vision"]).status_code == 202  # uploads are not S3 models


def _published(env: Env, uri: str, token: str) -> dict[str, Any]:
    response = submit(env, uri, token)
    assert response.status_code == 202, response.get_data(as_text=True)
    complete_build(env.services, response.json["build_id"])
    return dict(response.json)


def test_a_campaign_checks_the_source_builds_team_not_its_starter(make_env: EnvFactory, sqlite_url: str,
                                                                  s3_server: S3Server, world: World) -> None:
    """An admin (team "web-tests", not listed) rolls vision's artifact forward: allowed, as vision may read its
    model. Once an operator takes vision's bucket off the list, neither an admin's campaign nor a standing policy's
    (no principal) reads it again: each item is refused with the same words."""
    env = s3_env(make_env, sqlite_url, s3_server, world.setting())
    vision = tokens(env, "submit")["vision"]
    uri = f"s3://{world.vision}/resnet/model.pt"
    _published(env, uri, vision)
    moved = env.client.post("/v1/campaigns/rollforward",
                            json={"from_sdk": "2.13.0", "to_sdk": "2.14.0", "queue_anyway": True})
    assert moved.status_code == 201 and moved.json["progress"]["refused"] == 0, moved.get_data(as_text=True)

    tightened = s3_env(make_env, sqlite_url, s3_server, {"*": [f"s3://{world.public}/"]})
    plan = tightened.client.post("/v1/campaigns/rollforward", json={"from_sdk": "2.13.0", "to_sdk": "2.15.0",
                                                                     "dry_run": True}).json
    assert [f"team 'vision' may not read {uri}" in (item["refusal"] or "") for item in plan["items"]] == [True]
    started = tightened.client.post("/v1/campaigns/rollforward", json={"from_sdk": "2.13.0", "to_sdk": "2.15.0",
                                                                        "queue_anyway": True}).json
    assert started["progress"]["refused"] == 1, started
    assert f"team 'vision' may not read {uri}" in started["refusals"][0]["refusal"]

    # A standing policy's campaign submits for no principal: still the source build's team's list.
    selection = campaigns.Selection("2.13.0", "2.16.0", None, None, {}, False, None)
    campaign_id = campaigns.start(tightened.services.sessions, selection, policy_submit(Submitter(tightened.services)),
                                  None)
    with tightened.services.sessions() as session:
        [refusal] = session.scalars(select(CampaignItem.refusal).where(CampaignItem.campaign_id == campaign_id))
    assert refusal is not None and f"team 'vision' may not read {uri}" in refusal, refusal

    # A build from before tokens had teams rolls for no team: "*" only.
    with transaction(tightened.services.sessions) as session:
        session.execute(update(Build).values(team=None))
    selection = campaigns.Selection("2.13.0", "2.17.0", None, None, {}, False, None)
    campaign_id = campaigns.start(tightened.services.sessions, selection, policy_submit(Submitter(tightened.services)),
                                  None)
    with tightened.services.sessions() as session:
        [refusal] = session.scalars(select(CampaignItem.refusal).where(CampaignItem.campaign_id == campaign_id))
    assert refusal is not None and "a request without a team" in refusal, refusal


def test_a_rolled_build_is_its_source_teams_so_it_rolls_forward_again(make_env: EnvFactory, sqlite_url: str,
                                                                       s3_server: S3Server, world: World) -> None:
    """An admin of another team rolls vision's artifact forward, then a standing policy (no principal) rolls the
    result forward again: each rolled build is vision's (its model sources, its reads), so the second roll is
    checked against vision's list and allowed, not refused as a request without a team or as the admin's team."""
    env = s3_env(make_env, sqlite_url, s3_server, world.setting())
    vision = tokens(env, "submit")["vision"]
    _published(env, f"s3://{world.vision}/resnet/model.pt", vision)
    moved = env.client.post("/v1/campaigns/rollforward",
                            json={"from_sdk": "2.13.0", "to_sdk": "2.14.0", "queue_anyway": True}).json
    assert moved["progress"]["refused"] == 0, moved
    with env.services.sessions() as session:
        rolled = session.scalars(select(Build).where(Build.sdk == "2.14.0")).one()
        assert rolled.team == "vision" and rolled.submitted_by != "vision-ci", (rolled.team, rolled.submitted_by)
        rolled_id = rolled.id
    complete_build(env.services, rolled_id)

    selection = campaigns.Selection("2.14.0", "2.15.0", None, None, {}, False, None)
    campaign_id = campaigns.start(env.services.sessions, selection, policy_submit(Submitter(env.services)), None)
    with env.services.sessions() as session:
        [item] = session.scalars(select(CampaignItem).where(CampaignItem.campaign_id == campaign_id))
        assert item.refusal is None and item.build_id is not None, item.refusal
        assert session.get_one(Build, item.build_id).team == "vision"
