"""An operator's roll-forward whose API request died mid-loop, on Postgres: the relay submits the items the
request did not reach, as the campaign's token and team with its queue_anyway, each once even with two relays
racing; a token revoked since refuses them instead; a campaign not running, a policy's, or one older than a day
is left alone; the campaign finishes when its builds end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import tokens
from compilesvc.access.tokens import Principal
from compilesvc.builds.policy_submits import campaign_submit
from compilesvc.builds.submit import Submitter
from compilesvc.cli.daemon import RelayLoop
from compilesvc.ledger.campaigns import Campaign, CampaignItem
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Build
from compilesvc.lifecycle import campaigns, policies, resume
from compilesvc.pinning.pins import ModelPinning, PinnedModel
from compilesvc.states import CampaignState
from tests.fixtures.tokens import make_token
from tests.web.conftest import (
    EnvFactory,
    make_env,  # noqa: F401  (the fixture)
)
from tests.web.support import Env, complete_build, spec_for

SELECTION = campaigns.Selection("2.13.0", "2.14.0", None, "inf2", {"fleet": "search"}, False, None)


class StarterDied(BaseException):
    """The API worker submitting the campaign died (a BaseException: no ``except Exception`` catches it)."""


@pytest.fixture
def env(make_env: EnvFactory, pg_url: str) -> Env:  # noqa: F811
    return make_env(pg_url)


#: A starter in a process of its own (as a gunicorn worker runs the API's request): starts the campaign for
#: the token given, submits its first item and stalls inside the second's submit (a long pin), to be killed.
STARTER = """
import sys, time
from pathlib import Path
from compilesvc.access import tokens
from compilesvc.builds.policy_submits import campaign_submit
from compilesvc.builds.submit import Submitter
from compilesvc.lifecycle import campaigns
from compilesvc.services import Services
from tests.lifecycle.test_campaign_resume import SELECTION
from tests.web.support import make_settings

services = Services.from_settings(make_settings(Path(sys.argv[1]), sys.argv[2]))
with services.sessions() as session:
    principal = tokens.authenticate(session, sys.argv[3])
submit = campaign_submit(Submitter(services), principal, queue_anyway=True)
done = []

def stalling(document, model, team):
    if done:
        print("stalled", flush=True)
        time.sleep(3600)
    done.append(submit(document, model, team))
    return done[-1]

campaigns.start(services.sessions, SELECTION, stalling, principal, queue_anyway=True)
"""


def _fleet_with_artifacts(env: Env, count: int) -> list[str]:
    """``count`` published inf2 artifacts of 2.13.0, each its own model; their URIs."""
    uris = []
    for n in range(count):
        uris.append(env.upload(f"model {n}".encode()))
        build = env.submit(spec_for(uris[-1], target="inf2", labels={"fleet": "search"})).json
        complete_build(env.services, build["build_id"])
    return uris


def _operator(env: Env, team: str = "vision") -> Principal:
    """An admin token of ``team``, as the API authenticates it."""
    secret = make_token(env.services.sessions, "admin", owner="ops@example.com", team=team, name="rollout")
    with env.services.sessions() as session:
        principal = tokens.authenticate(session, secret)
    assert principal is not None
    return principal


def _started(env: Env, principal: Principal, submitted_before_death: int, *, queue_anyway: bool = True,
             claims_expired: bool = True) -> int:
    """What ``POST /v1/campaigns/rollforward`` does (campaigns.start with the API's submit), its worker killed
    while submitting item ``submitted_before_death + 1`` (its claim on it held); the campaign past the relay's
    grace and, ``claims_expired``, its dead claim past CLAIM_SECONDS. The campaign's id."""
    submit = campaign_submit(Submitter(env.services), principal, queue_anyway=queue_anyway)
    done: list[dict[str, Any]] = []

    def dying(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
        if len(done) == submitted_before_death:
            raise StarterDied
        done.append(document)
        return submit(document, model, team)

    with pytest.raises(StarterDied):
        campaigns.start(env.services.sessions, SELECTION, dying, principal, queue_anyway=queue_anyway)
    with transaction(env.services.sessions) as session:
        campaign = session.scalars(select(Campaign).order_by(Campaign.id.desc())).first()
        assert campaign is not None and campaign.state == CampaignState.RUNNING
        campaign.created_at -= timedelta(seconds=policies.START_GRACE_SECONDS + 1)
        if claims_expired:
            _age_claims(session, campaign.id)
        return campaign.id


def _age_claims(session: Session, campaign_id: int) -> None:
    for item in session.scalars(select(CampaignItem).where(CampaignItem.campaign_id == campaign_id,
                                                           CampaignItem.submit_claimed_at.is_not(None))):
        item.submit_claimed_at -= timedelta(seconds=campaigns.CLAIM_SECONDS + 1)  # type: ignore[operator]


def _items(env: Env, campaign_id: int) -> list[tuple[int | None, str | None]]:
    with env.services.sessions() as session:
        return [(i.build_id, i.refusal) for i in session.scalars(
            select(CampaignItem).where(CampaignItem.campaign_id == campaign_id).order_by(CampaignItem.id))]


def _counting(env: Env, into: list[dict[str, Any]]) -> resume.SubmitAs:
    """The relay's submit (RelayLoop.resume_campaigns), noting each document and who it submits as."""
    submitter = Submitter(env.services)

    def submit_as(principal: Principal | None, queue_anyway: bool) -> campaigns.SubmitDocument:
        submit = campaign_submit(submitter, principal, queue_anyway=queue_anyway)

        def counted(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
            into.append({**document, "as": principal.team if principal else None})
            return submit(document, model, team)

        return counted

    return submit_as


def _models(documents: list[dict[str, Any]]) -> list[str]:
    return sorted(str(d["model"]["uri"]) for d in documents)


def test_the_relay_submits_what_a_dead_api_request_left_as_the_campaigns_team(env: Env) -> None:
    """Killed after one item of three, while submitting the second: the relay's pass (RelayLoop.resume_campaigns,
    `compilesvc relay`) submits the third at once and the second once its claim is CLAIM_SECONDS old (the
    request may have been slow, not dead); never the first again. Every build is the campaign's owner's and
    token's and its source build's team's (whose model and fleet it is, not the operator's), queued though no
    worker serves 2.14.0 (the request's queue_anyway, recorded). Policies' pass leaves it alone. The builds
    ending finish the campaign."""
    uris = _fleet_with_artifacts(env, 3)
    principal = _operator(env)
    loop = RelayLoop(env.services, env.services.relay)
    campaign_id = _started(env, principal, 1, claims_expired=False)
    with transaction(env.services.sessions) as session:  # within the grace: its request may be submitting it
        session.get_one(Campaign, campaign_id).created_at += timedelta(seconds=policies.START_GRACE_SECONDS)
    assert loop.resume_campaigns() == 0
    with transaction(env.services.sessions) as session:
        session.get_one(Campaign, campaign_id).created_at -= timedelta(seconds=policies.START_GRACE_SECONDS)
    assert [build is None for build, _ in _items(env, campaign_id)] == [False, True, True]
    assert policies.start_stalled(env.services.sessions, lambda d, _m: 0) == []  # not a policy's

    assert loop.resume_campaigns() == 1
    assert [build is None for build, _ in _items(env, campaign_id)] == [False, True, False]
    assert loop.resume_campaigns() == 0  # the second's claim is young: its claimer may be alive
    with transaction(env.services.sessions) as session:
        _age_claims(session, campaign_id)
    submitted: list[dict[str, Any]] = []
    assert resume.resume_stalled(env.services.sessions, _counting(env, submitted)) == [campaign_id]
    assert _models(submitted) == [uris[1]] and submitted[0]["as"] == "vision"
    assert resume.resume_stalled(env.services.sessions, _counting(env, submitted)) == [] and len(submitted) == 1

    items = _items(env, campaign_id)
    assert all(build is not None and refusal is None for build, refusal in items), items
    with env.services.sessions() as session:
        builds = [session.get_one(Build, build_id) for build_id, _ in items]
        [source_team] = set(session.scalars(select(Build.team).where(Build.sdk == "2.13.0")))
        assert source_team != principal.team
        assert {(b.team, b.submitted_by, b.token_id) for b in builds} == {
            (source_team, "ops@example.com", principal.token_id)}
        assert {(b.spec["sdk"], b.spec["labels"]["campaign"]) for b in builds} == {("2.14.0", str(campaign_id))}
    url = f"/v1/campaigns/{campaign_id}"
    for build_id, _ in items[:2]:
        complete_build(env.services, build_id)  # type: ignore[arg-type]
    assert env.client.get(url).json["state"] == "running"
    complete_build(env.services, items[2][0])  # type: ignore[arg-type]
    done = env.client.get(url).json
    assert done["state"] == "finished" and done["progress"]["built"] == 3, done["progress"]


def test_two_relays_resuming_one_campaign_submit_each_item_once(env: Env) -> None:
    """A second relay's whole pass runs while the first is submitting its first item: the second skips the
    item the first claimed and submits the rest; the first then finds them claimed. Each item once."""
    uris = _fleet_with_artifacts(env, 3)
    campaign_id = _started(env, _operator(env), 0)
    sessions = env.services.sessions
    by_relay: dict[str, list[dict[str, Any]]] = {"first": [], "second": []}
    second = _counting(env, by_relay["second"])
    first_as = _counting(env, by_relay["first"])

    def first(principal: Principal | None, queue_anyway: bool) -> campaigns.SubmitDocument:
        submit = first_as(principal, queue_anyway)

        def racing(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
            if not by_relay["first"]:  # the other relay passes meanwhile
                assert resume.resume_stalled(sessions, second) == [campaign_id]
            return submit(document, model, team)

        return racing

    assert resume.resume_stalled(sessions, first) == [campaign_id]
    assert _models(by_relay["first"]) == [uris[0]] and _models(by_relay["second"]) == sorted(uris[1:])
    assert len({build for build, _ in _items(env, campaign_id)} - {None}) == 3
    assert {d["as"] for d in by_relay["first"] + by_relay["second"]} == {"vision"}


def test_a_token_revoked_since_refuses_the_rest_and_the_campaign_settles(env: Env) -> None:
    """The token that started the campaign was revoked before the relay came: nothing more is submitted in its
    name; the items left are refused saying why, once, and the campaign finishes when its one build ends."""
    _fleet_with_artifacts(env, 3)
    principal = _operator(env)
    campaign_id = _started(env, principal, 1)
    with transaction(env.services.sessions) as session:
        assert tokens.revoke(session, principal.token_id) is not None
    never: list[dict[str, Any]] = []
    assert resume.resume_stalled(env.services.sessions, _counting(env, never)) == [campaign_id]
    assert never == []
    (built, _), *refused = _items(env, campaign_id)
    assert built is not None and [build for build, _ in refused] == [None, None]
    assert all("token 'rollout'" in str(r) and "was revoked" in str(r) and "start the roll-forward again"
               in str(r) for _, r in refused), refused
    assert resume.resume_stalled(env.services.sessions, _counting(env, never)) == []
    url = f"/v1/campaigns/{campaign_id}"
    assert env.client.get(url).json["progress"]["refused"] == 2 and env.client.get(url).json["state"] == "running"
    complete_build(env.services, built)
    assert env.client.get(url).json["state"] == "finished"


def test_a_request_without_worker_resumes_without_queue_anyway(env: Env) -> None:
    """Started without queue_anyway (as the request asked): the relay does not queue either, so with no worker
    of 2.14.0 the items left are refused as the request's own submits would have been."""
    _fleet_with_artifacts(env, 2)
    campaign_id = _started(env, _operator(env), 0, queue_anyway=False)
    assert resume.resume_stalled(env.services.sessions, _counting(env, [])) == [campaign_id]
    refusals = [refusal for _, refusal in _items(env, campaign_id)]
    assert all(refusal and "2.14.0" in refusal for refusal in refusals), refusals


def test_campaigns_not_running_of_a_policy_or_a_day_old_are_left_alone(env: Env) -> None:
    """Only a running campaign is resumed (no other state keeps items open: a campaign set otherwise meanwhile
    is not the relay's to continue); a policy's is its policy's (policies.start_stalled); one older than
    MAX_START_AGE_SECONDS predates the relay or outlived an outage."""
    _fleet_with_artifacts(env, 2)
    campaign_id = _started(env, _operator(env), 1)
    sessions = env.services.sessions
    never: list[dict[str, Any]] = []
    with transaction(sessions) as session:
        session.get_one(Campaign, campaign_id).state = CampaignState.FINISHED
    assert resume.resume_stalled(sessions, _counting(env, never)) == [] and never == []

    with transaction(sessions) as session:
        campaign = session.get_one(Campaign, campaign_id)
        campaign.state = CampaignState.RUNNING
        campaign.created_at -= timedelta(seconds=policies.MAX_START_AGE_SECONDS)
    assert resume.resume_stalled(sessions, _counting(env, never)) == [] and never == []

    with transaction(sessions) as session:
        campaign = session.get_one(Campaign, campaign_id)
        campaign.created_at += timedelta(seconds=policies.MAX_START_AGE_SECONDS)
        campaign.policy_id = policies.add(session, name="search", enabled=False).id
    assert resume.resume_stalled(sessions, _counting(env, never)) == [] and never == []

    with transaction(sessions) as session:  # its policy removed: an orphan the relay resumes, as recorded
        session.get_one(Campaign, campaign_id).policy_id = None
    assert resume.resume_stalled(sessions, _counting(env, never)) == [campaign_id] and len(never) == 1
    assert all(build is not None for build, _ in _items(env, campaign_id))


def test_a_starter_process_killed_mid_loop_is_finished_by_the_relay(env: Env, pg_url: str, tmp_path: Path) -> None:
    """The process running the campaign's submits is SIGKILLed while submitting the second item of three
    (no cleanup runs: its claim stays): once the claim is CLAIM_SECONDS old, one relay pass submits the two
    left as the campaign's team, and their builds ending finish the campaign."""
    _fleet_with_artifacts(env, 3)
    secret = make_token(env.services.sessions, "admin", owner="ops@example.com", team="vision", name="rollout")
    root = Path(__file__).resolve().parents[2]
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / "env0"), pg_url, secret],
                               stdout=subprocess.PIPE, text=True, cwd=root,
                               env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert starter.stdout is not None and starter.stdout.readline() == "stalled\n"
    finally:
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(60)
    with transaction(env.services.sessions) as session:
        (campaign,) = session.scalars(select(Campaign))
        campaign.created_at -= timedelta(seconds=policies.START_GRACE_SECONDS + 1)
        campaign_id = campaign.id
    assert [(build is None, refusal) for build, refusal in _items(env, campaign_id)] == [
        (False, None), (True, None), (True, None)]
    loop = RelayLoop(env.services, env.services.relay)
    assert loop.resume_campaigns() == 1  # the third; the second's claim is still young
    with transaction(env.services.sessions) as session:
        _age_claims(session, campaign_id)
    assert loop.resume_campaigns() == 1 and loop.resume_campaigns() == 0
    items = _items(env, campaign_id)
    with env.services.sessions() as session:
        sources = set(session.scalars(select(Build.team).where(Build.sdk == "2.13.0")))  # each its source's team
        assert {session.get_one(Build, build_id).team for build_id, _ in items} == sources  # type: ignore[arg-type]
    for build_id, _ in items:
        complete_build(env.services, build_id)  # type: ignore[arg-type]
    assert env.client.get(f"/v1/campaigns/{campaign_id}").json["state"] == "finished"


def test_an_item_whose_model_is_being_hashed_is_left_for_the_relay_not_refused(env: Env) -> None:
    """A submit that answers ModelPinning (the model hashed in the background) is no refusal: the item keeps
    neither build nor refusal, its claim let go, and the relay's next pass submits it."""
    _fleet_with_artifacts(env, 2)
    principal = _operator(env)
    submit = campaign_submit(Submitter(env.services), principal, queue_anyway=True)

    def pinning_first(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
        if document["model"]["uri"] == first_uri:
            raise ModelPinning(document["model"]["uri"], 1, 10, 5)
        return submit(document, model, team)

    with env.services.sessions() as session:
        first_uri = session.scalars(select(Build.spec).where(Build.sdk == "2.13.0").order_by(Build.id)).first()[
            "model"]["uri"]
    campaign_id = campaigns.start(env.services.sessions, SELECTION, pinning_first, principal, queue_anyway=True)
    items = _items(env, campaign_id)
    assert sorted(build is None for build, _ in items) == [False, True] and all(r is None for _, r in items), items
    with env.services.sessions() as session:
        claims = set(session.scalars(select(CampaignItem.submit_claimed_at).where(
            CampaignItem.campaign_id == campaign_id, CampaignItem.build_id.is_(None))))
    assert claims == {None}
    with transaction(env.services.sessions) as session:
        session.get_one(Campaign, campaign_id).created_at -= timedelta(seconds=policies.START_GRACE_SECONDS + 1)
    assert RelayLoop(env.services, env.services.relay).resume_campaigns() == 1
    assert all(build is not None and refusal is None for build, refusal in _items(env, campaign_id))
