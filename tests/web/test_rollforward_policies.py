"""Standing roll-forward policies through the API on both ledgers: add, list, show, remove; every bad
field a 422 naming it, a name taken a 409; a registration of a release new to the fleet fires each enabled
policy covering its target once, and the campaign it starts is listed with the policy."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from compilesvc.builds.policy_submits import policy_submit
from compilesvc.builds.submit import Submitter
from compilesvc.cli.daemon import RelayLoop
from compilesvc.dispatch import registry
from compilesvc.ledger.campaigns import Campaign, CampaignItem, PolicyRun
from compilesvc.ledger.engine import transaction
from compilesvc.lifecycle import campaigns, policies
from compilesvc.pinning.pins import PinnedModel
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem


def add(env: Env, **body: Any) -> Any:
    return env.client.post("/v1/rollforward-policies", json={"name": "search", **body})


def caps(sdk: str, *targets: str) -> dict[str, Any]:
    return {"targets": list(targets), "sdk": dict.fromkeys(targets, sdk)}


def test_policies_are_added_listed_shown_and_removed(env: Env) -> None:
    made = add(env, target="inf2", labels={"fleet": "search"}, from_sdk="2.13.0")
    assert made.status_code == 201, made.json
    policy = made.json
    assert made.headers["Location"] == policy["url"]
    assert {k: policy[k] for k in ("name", "target", "from_sdk", "labels", "enabled", "runs")} == {
        "name": "search", "target": "inf2", "from_sdk": "2.13.0", "labels": {"fleet": "search"}, "enabled": True,
        "runs": []}
    assert [p["name"] for p in env.client.get("/v1/rollforward-policies").json["items"]] == ["search"]
    assert env.client.get("/v1/rollforward-policies/search").json["id"] == policy["id"]
    assert env.client.get(f"/v1/rollforward-policies/{policy['id']}").json["name"] == "search"
    assert env.client.post("/v1/rollforward-policies/search/disable").json["enabled"] is False
    assert env.client.get("/v1/rollforward-policies/search").json["enabled"] is False
    assert env.client.post(f"/v1/rollforward-policies/{policy['id']}/enable").json["enabled"] is True
    assert_problem(env.client.post("/v1/rollforward-policies/nobody/enable"), 404, "policy-not-found")
    assert env.client.delete("/v1/rollforward-policies/search").json["id"] == policy["id"]
    assert env.client.get("/v1/rollforward-policies").json["items"] == []
    assert_problem(env.client.get("/v1/rollforward-policies/search"), 404, "policy-not-found")
    assert_problem(env.client.delete("/v1/rollforward-policies/search"), 404, "policy-not-found")


def test_bad_fields_are_422s_naming_the_field_and_a_name_taken_is_409(env: Env) -> None:
    for body, field in (({"name": "has space"}, "name"), ({"target": "tpu"}, "target"),
                        ({"from_sdk": "2.13"}, "from_sdk"), ({"fetched_within_days": 0}, "fetched_within_days"),
                        ({"labels": {"": "x"}}, "labels"), ({"enabled": "yes"}, "enabled"),
                        ({"colour": "red"}, "colour")):
        problem = assert_problem(add(env, **body), 422, "policy-invalid")
        assert any(e["field"].split(".")[0].split("[")[0] == field for e in problem["errors"]), (body, problem)
    assert add(env).status_code == 201
    assert_problem(add(env), 409, "policy-exists")
    assert add(env, name="1").status_code == 201  # a name of digits is a name, whatever policy has that id
    assert env.client.get("/v1/rollforward-policies/1").json["name"] == "1"  # a name wins over an id
    assert_problem(add(env, name="1"), 409, "policy-exists")


def test_a_new_release_fires_each_covering_policy_once_and_its_campaign_is_listed(env: Env) -> None:
    build = env.submit(spec_for(env.upload(b"model a"), target="inf2", labels={"fleet": "search"})).json
    complete_build(env.services, build["build_id"])
    sessions = env.services.sessions
    with transaction(sessions) as session:  # the fleet so far: a worker of 2.13.0 (no policy yet)
        assert policies.claim(session, "w-old", caps("2.13.0", "inf2", "trn1")) == []
    for body in ({"name": "any-neuron"}, {"name": "trn1-only", "target": "trn1"}, {"name": "cpu", "target": "cpu"},
                 {"name": "off", "enabled": False}):
        assert add(env, **body).status_code == 201
    with transaction(sessions) as session:  # a restart of the old release: not new
        assert policies.claim(session, "w-old-2", caps("2.13.0", "inf2", "trn1")) == []
    with transaction(sessions) as session:
        claims = policies.claim(session, "w-new", caps("2.14.0", "inf2"))
    assert [(c.target, c.to_sdk) for c in claims] == [("inf2", "2.14.0")]  # any-neuron; trn1-only waits

    def submit(document: dict[str, Any], model: PinnedModel | None = None, team: str | None = None) -> int:
        return int(env.submit(document).json["build_id"])

    campaign_id = policies.start_claimed(sessions, claims[0], submit)
    assert campaign_id is not None
    with transaction(sessions) as session:  # another worker of 2.14.0, with trn1 too: only trn1-only fires
        again = policies.claim(session, "w-new-2", caps("2.14.0", "inf2", "trn1"))
    assert [(c.target, c.to_sdk) for c in again] == [("trn1", "2.14.0")]
    assert policies.start_claimed(sessions, again[0], submit) is None  # no trn1 artifacts to move
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(PolicyRun)) == 2

    shown = env.client.get("/v1/rollforward-policies/any-neuron").json
    (run,) = shown["runs"]
    assert (run["to_sdk"], run["from_sdk"], run["campaign_id"], run["worker_id"]) == (
        "2.14.0", "2.13.0", campaign_id, "w-new")
    campaign = env.client.get(f"/v1/campaigns/{campaign_id}").json
    assert campaign["policy_id"] == shown["id"] and campaign["progress"]["total"] == 1
    (trn1_run,) = env.client.get("/v1/rollforward-policies/trn1-only").json["runs"]
    assert trn1_run["campaign_id"] is None and "no older release" in trn1_run["note"]


def test_the_campaigns_page_lists_policies_and_the_campaigns_they_started(env: Env) -> None:
    from tests.web.test_ui_pages import page, text_of

    assert "No standing policy" in text_of(page(env, "/campaigns"))
    build = env.submit(spec_for(env.upload(b"model a"), target="inf2")).json
    complete_build(env.services, build["build_id"])
    with transaction(env.services.sessions) as session:
        policies.claim(session, "w-old", caps("2.13.0", "inf2"))
    assert add(env, labels={"fleet": "search"}).status_code == 201
    assert add(env, name="idle", target="trn2", enabled=False).status_code == 201
    with transaction(env.services.sessions) as session:
        (claimed,) = policies.claim(session, "w-new", caps("2.14.0", "inf2"))
    campaign_id = policies.start_claimed(env.services.sessions, claimed,
                                         lambda d, *_: int(env.submit(d).json["build_id"]))
    words = text_of(page(env, "/campaigns"))
    assert "search enabled" in words and "fleet=search" in words and "idle disabled" in words, words
    assert "2.14.0 (inf2, first worker w-new" in words and f"campaign {campaign_id} from 2.13.0" in words, words
    assert "2.13.0 → 2.14.0" in words and "policy search" in words and "not fired yet" in words, words


def _fleet_with_an_artifact(env: Env) -> None:
    """A published inf2 artifact of 2.13.0, and 2.13.0 seen by the fleet."""
    build = env.submit(spec_for(env.upload(b"model a"), target="inf2", labels={"fleet": "search"})).json
    complete_build(env.services, build["build_id"])
    with transaction(env.services.sessions) as session:
        assert policies.claim(session, "w-old", caps("2.13.0", "inf2")) == []


def _campaigns(env: Env) -> list[tuple[int | None, str]]:
    with env.services.sessions() as session:
        return [(c.policy_id, c.to_sdk) for c in session.scalars(select(Campaign).order_by(Campaign.id))]


def test_a_run_whose_worker_died_before_its_campaign_is_started_by_the_relay_once(env: Env) -> None:
    """The registering worker claimed the run and died before submitting: after the grace the relay's pass
    (compilesvc relay: RelayLoop.start_stalled_policy_runs) starts it; later passes, another relay, or the worker
    come back late, start no second campaign (migration 0020's unique index)."""
    _fleet_with_an_artifact(env)
    assert add(env).status_code == 201
    sessions = env.services.sessions
    with transaction(sessions) as session:
        (claimed,) = policies.claim(session, "w-new", caps("2.14.0", "inf2"))  # … and the worker dies here
    loop = RelayLoop(env.services, env.services.relay)
    assert loop.start_stalled_policy_runs() == 0  # within the grace: its worker may be starting it
    with transaction(sessions) as session:  # the grace has passed
        session.get_one(PolicyRun, claimed.run_id).created_at -= timedelta(seconds=policies.START_GRACE_SECONDS + 1)
    assert loop.start_stalled_policy_runs() == 1
    (run,) = env.client.get("/v1/rollforward-policies/search").json["runs"]
    assert run["campaign_id"] is not None and run["from_sdk"] == "2.13.0" and run["note"] is None
    assert env.client.get(f"/v1/campaigns/{run['campaign_id']}").json["progress"]["total"] == 1
    assert RelayLoop(env.services, env.services.relay).start_stalled_policy_runs() == 0  # a second relay

    # The worker was only slow: its start finds the campaign and names it, no second one.
    submitted: list[dict[str, Any]] = []
    assert policies.start_claimed(sessions, claimed, lambda d, *_: submitted.append(d) or 0) == run["campaign_id"]
    assert submitted == [] and len(_campaigns(env)) == 1

    # A campaign created by one starter that died before naming it in its run: the relay names it.
    with transaction(sessions) as session:
        session.get_one(PolicyRun, claimed.run_id).campaign_id = None
    assert policies.start_stalled(sessions, lambda d, *_: submitted.append(d) or 0, 0) == [run["campaign_id"]]
    assert submitted == [] and len(_campaigns(env)) == 1

    # Two starters past each other's check: the ledger refuses the second campaign.
    with pytest.raises(IntegrityError):
        campaigns.start(sessions, campaigns.Selection("2.13.0", "2.14.0", None, None, {}, False, None),
                        lambda d, *_: 0, None, policy_id=claimed.policy_id)
    assert len(_campaigns(env)) == 1


def test_a_policy_enabled_again_catches_up_with_the_releases_it_missed(env: Env) -> None:
    """Disabled when 2.14.0's first worker registered: enabling it starts that roll-forward at once (the
    release is live), not for a release no live worker serves, and enabling it again starts nothing more."""
    _fleet_with_an_artifact(env)
    assert add(env, enabled=False).status_code == 201
    sessions = env.services.sessions
    for worker, sdk in (("w-new", "2.14.0"), ("w-gone", "2.15.0")):
        with transaction(sessions) as session:
            registry.register(session, worker, "host", caps(sdk, "inf2"), [], 1)
            assert policies.claim(session, worker, caps(sdk, "inf2")) == []  # disabled: no run
    with transaction(sessions) as session:  # the 2.15.0 worker stopped: that release is not live
        registry.mark_stopped(session, "w-gone")
    enabled = env.client.post("/v1/rollforward-policies/search/enable")
    assert enabled.status_code == 200, enabled.json
    (run,) = enabled.json["runs"]
    assert (run["to_sdk"], run["from_sdk"], run["target"]) == ("2.14.0", "2.13.0", "inf2")
    assert run["campaign_id"] is not None and run["worker_id"].startswith("enabled")
    assert env.client.get(f"/v1/campaigns/{run['campaign_id']}").json["progress"]["total"] == 1
    assert env.client.post("/v1/rollforward-policies/search/enable").json["runs"] == enabled.json["runs"]
    env.client.post("/v1/rollforward-policies/search/disable")
    assert len(env.client.post("/v1/rollforward-policies/search/enable").json["runs"]) == 1  # has its run
    assert _campaigns(env) == [(enabled.json["id"], "2.14.0")]


def test_a_policy_created_now_does_not_fire_for_the_live_release(env: Env) -> None:
    """Created (enabled) while 2.14.0 is live: it waits for the next release, as the docs say."""
    _fleet_with_an_artifact(env)
    with transaction(env.services.sessions) as session:
        registry.register(session, "w-new", "host", caps("2.14.0", "inf2"), [], 1)
        policies.claim(session, "w-new", caps("2.14.0", "inf2"))
    assert add(env).json["runs"] == []
    env.client.post("/v1/rollforward-policies/search/disable")
    assert env.client.post("/v1/rollforward-policies/search/enable").json["runs"] == []


class StarterDied(BaseException):
    """The process starting a campaign died (a BaseException: no ``except Exception`` in our code catches it)."""


def _fleet_with_artifacts(env: Env, count: int) -> list[str]:
    """``count`` published inf2 artifacts of 2.13.0 (each its own model), 2.13.0 seen by the fleet."""
    uris = []
    for n in range(count):
        uris.append(env.upload(f"model {n}".encode()))
        build = env.submit(spec_for(uris[-1], target="inf2", labels={"fleet": "search"})).json
        complete_build(env.services, build["build_id"])
    with transaction(env.services.sessions) as session:
        assert policies.claim(session, "w-old", caps("2.13.0", "inf2")) == []
    return uris


def _half_submitted(env: Env, submitted_before_death: int, *, long_ago: bool = True) -> tuple[policies.Claim, int]:
    """A policy's run whose starter created the campaign, submitted ``submitted_before_death`` items and died
    submitting the next (its claim on that item held); the run and its campaign past the relay's grace, and
    ``long_ago``: the claim too (campaigns.CLAIM_SECONDS). The claim and the campaign's id."""
    sessions = env.services.sessions
    with transaction(sessions) as session:
        (claimed,) = policies.claim(session, "w-new", caps("2.14.0", "inf2"))
    calls: list[dict[str, Any]] = []

    def dying(document: dict[str, Any], model: PinnedModel | None = None, team: str | None = None) -> int:
        if len(calls) == submitted_before_death:
            raise StarterDied
        calls.append(document)
        return int(env.submit(document).json["build_id"])

    with pytest.raises(StarterDied):
        policies.start_claimed(sessions, claimed, dying)
    with transaction(sessions) as session:
        (campaign,) = session.scalars(select(Campaign).where(Campaign.policy_id == claimed.policy_id))
        ago = timedelta(seconds=(campaigns.CLAIM_SECONDS if long_ago else policies.START_GRACE_SECONDS) + 1)
        session.get_one(PolicyRun, claimed.run_id).created_at -= ago
        campaign.created_at -= ago
        if long_ago:
            _age_claims(session, campaign.id)
        return claimed, campaign.id


def _age_claims(session: Session, campaign_id: int) -> None:
    for item in session.scalars(select(CampaignItem).where(CampaignItem.campaign_id == campaign_id,
                                                           CampaignItem.submit_claimed_at.is_not(None))):
        item.submit_claimed_at -= timedelta(seconds=campaigns.CLAIM_SECONDS + 1)  # type: ignore[operator]


def _items(env: Env, campaign_id: int) -> list[tuple[str, int | None, str | None]]:
    with env.services.sessions() as session:
        return [(i.source_key, i.build_id, i.refusal) for i in session.scalars(
            select(CampaignItem).where(CampaignItem.campaign_id == campaign_id).order_by(CampaignItem.id))]


def _models(documents: list[dict[str, Any]]) -> list[str]:
    return sorted(str(d["model"]["uri"]) for d in documents)


def test_a_campaign_whose_starter_died_mid_loop_is_finished_by_the_relay(env: Env) -> None:
    """The worker (or the API's enable request) died after submitting one item of three, while submitting the
    second: the run names no campaign and two items have neither a build nor a refusal. The relay names the
    campaign in the run and submits the third; the second once its claim is CLAIM_SECONDS old (its claimer
    may have been slow, not dead); never the first again. Its builds ending finish the campaign."""
    uris = _fleet_with_artifacts(env, 3)
    assert add(env).status_code == 201
    claimed, campaign_id = _half_submitted(env, 1, long_ago=False)
    assert [build is None for _, build, _ in _items(env, campaign_id)] == [False, True, True]
    submitted: list[dict[str, Any]] = []
    submit = policy_submit(Submitter(env.services))

    def counted(document: dict[str, Any], model: PinnedModel | None = None, team: str | None = None) -> int:
        submitted.append(document)
        return submit(document, model, team)

    assert policies.start_stalled(env.services.sessions, counted) == [campaign_id]
    assert _models(submitted) == [uris[2]]  # the item it had not reached
    assert policies.start_stalled(env.services.sessions, counted) == [] and len(submitted) == 1
    with transaction(env.services.sessions) as session:
        _age_claims(session, campaign_id)
    assert policies.start_stalled(env.services.sessions, counted) == [campaign_id]
    assert _models(submitted) == sorted(uris[1:])  # and the one its dead starter held
    assert all(d["sdk"] == "2.14.0" and d["labels"]["campaign"] == str(campaign_id) for d in submitted)
    items = _items(env, campaign_id)
    assert all(build is not None and refusal is None for _, build, refusal in items), items
    with env.services.sessions() as session:
        assert session.get_one(PolicyRun, claimed.run_id).campaign_id == campaign_id
    assert policies.start_stalled(env.services.sessions, counted) == [] and len(submitted) == 2  # nothing left
    for _, build_id, _ in items:
        complete_build(env.services, build_id)  # type: ignore[arg-type]
    assert env.client.get(f"/v1/campaigns/{campaign_id}").json["state"] == "finished"


def test_two_relays_resuming_one_campaign_submit_each_item_once(env: Env) -> None:
    """A second relay's whole pass runs while the first is submitting its first item: the second skips the
    item the first claimed and submits the rest; the first then finds them claimed. Each item once."""
    uris = _fleet_with_artifacts(env, 3)
    assert add(env).status_code == 201
    _, campaign_id = _half_submitted(env, 0)
    sessions = env.services.sessions
    submit = policy_submit(Submitter(env.services))
    by_relay: dict[str, list[dict[str, Any]]] = {"first": [], "second": []}

    def second(document: dict[str, Any], model: PinnedModel | None = None, team: str | None = None) -> int:
        by_relay["second"].append(document)
        return submit(document, model, team)

    def first(document: dict[str, Any], model: PinnedModel | None = None, team: str | None = None) -> int:
        by_relay["first"].append(document)
        if len(by_relay["first"]) == 1:  # the other relay passes meanwhile
            assert policies.start_stalled(sessions, second) == [campaign_id]
        return submit(document, model, team)

    assert policies.start_stalled(sessions, first) == [campaign_id]
    assert _models(by_relay["first"]) == [uris[0]] and _models(by_relay["second"]) == sorted(uris[1:])
    assert len({build for _, build, _ in _items(env, campaign_id)} - {None}) == 3


def test_the_relay_starts_no_run_of_a_disabled_policy_nor_an_old_one(env: Env) -> None:
    """Disabled after its run was claimed (its worker died): the relay starts nothing, nor resumes its half-
    submitted campaign; enabled again, it does. A run older than MAX_START_AGE_SECONDS (a ledger upgraded from
    before the relay) is left to an operator."""
    _fleet_with_artifacts(env, 2)
    assert add(env).status_code == 201
    sessions = env.services.sessions
    with transaction(sessions) as session:
        (claimed,) = policies.claim(session, "w-new", caps("2.14.0", "inf2"))
        session.flush()
        session.get_one(PolicyRun, claimed.run_id).created_at -= timedelta(seconds=policies.START_GRACE_SECONDS + 1)
    never: list[dict[str, Any]] = []
    assert env.client.post("/v1/rollforward-policies/search/disable").status_code == 200
    assert policies.start_stalled(sessions, lambda d, *_: never.append(d) or 0) == [] and never == []
    assert _campaigns(env) == []

    with transaction(sessions) as session:  # enabled again, but the run is a day old
        session.get_one(PolicyRun, claimed.run_id).created_at -= timedelta(seconds=policies.MAX_START_AGE_SECONDS)
    assert env.client.post("/v1/rollforward-policies/search/enable").status_code == 200
    assert policies.start_stalled(sessions, lambda d, *_: never.append(d) or 0) == [] and never == []
    assert _campaigns(env) == []

    with transaction(sessions) as session:  # a younger run: started
        session.get_one(PolicyRun, claimed.run_id).created_at += timedelta(seconds=policies.MAX_START_AGE_SECONDS)
    assert len(policies.start_stalled(sessions, lambda d, *_: int(env.submit(d).json["build_id"]))) == 1


def test_the_relay_resumes_no_campaign_of_a_disabled_policy(env: Env) -> None:
    _fleet_with_artifacts(env, 2)
    assert add(env).status_code == 201
    _, campaign_id = _half_submitted(env, 1)
    never: list[dict[str, Any]] = []
    assert env.client.post("/v1/rollforward-policies/search/disable").status_code == 200
    assert policies.start_stalled(env.services.sessions, lambda d, *_: never.append(d) or 0) == [] and never == []
    assert [build is None for _, build, _ in _items(env, campaign_id)] == [False, True]
    assert env.client.post("/v1/rollforward-policies/search/enable").status_code == 200
    assert policies.start_stalled(env.services.sessions, lambda d, *_: int(env.submit(d).json["build_id"])) == [
        campaign_id]
    assert all(build is not None for _, build, _ in _items(env, campaign_id))
