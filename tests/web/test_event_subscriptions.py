"""Service-wide events for a deployment system: a URL subscribed to ``artifact.published``,
``build.failed`` and ``campaign.finished`` gets one signed POST per event (an artifact published once,
however many builds follow it), written in the transaction that made the event and sent by the relay."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from compilesvc.notify.webhooks import verify
from tests.web.conftest import EnvFactory
from tests.web.support import complete_build, fail_build, spec_for
from tests.web.test_submit import assert_problem
from tests.web.test_webhooks import SECRET, Receiver, relay_pass, webhook_env


@pytest.fixture
def deploy_system() -> Iterator[Receiver]:
    server = Receiver([])
    yield server
    server.close()


def events(receiver: Receiver) -> list[dict[str, Any]]:
    for headers, body, _ in receiver.received:
        assert verify(SECRET.encode(), headers, body)
    return [json.loads(body) for _, body, _ in receiver.received]


def test_a_deployment_system_hears_of_artifacts_failures_and_campaigns(make_env: EnvFactory, ledger_url: str,
                                                                       deploy_system: Receiver) -> None:
    env = webhook_env(make_env, ledger_url)
    for event in ("artifact.published", "build.failed", "campaign.finished"):
        made = env.client.post("/v1/subscriptions", json={"url": deploy_system.url, "event": event})
        assert made.status_code == 201, made.json
    again = env.client.post("/v1/subscriptions", json={"url": deploy_system.url, "event": "build.failed"})
    assert again.status_code == 200  # the same subscription, not a second one

    uri = env.upload()
    first = env.submit(spec_for(uri, labels={"fleet": "search"})).json
    joined = env.submit(spec_for(uri, labels={"fleet": "search"})).json
    assert joined["outcome"] == "join"
    complete_build(env.services, first["build_id"])
    assert env.submit(spec_for(uri)).json["outcome"] == "hit"  # a hit publishes nothing new
    failing = env.submit(spec_for(uri, buckets=((8, 8),))).json
    fail_build(env.services, failing["build_id"])
    campaign = env.client.post("/v1/campaigns/rollforward",
                               json={"from_sdk": "2.13.0", "to_sdk": "2.14.0", "queue_anyway": True}).json
    complete_build(env.services, campaign["items"][0]["build_id"])
    while relay_pass(env):
        pass

    got = events(deploy_system)
    assert sorted(e["type"] for e in got) == ["artifact.published", "artifact.published", "build.failed",
                                              "campaign.finished"]
    published = [e["artifact"] for e in got if e["type"] == "artifact.published"]
    assert published[0]["key"] == first["artifact_key"] and published[0]["labels"] == {"fleet": "search"}
    assert published[0]["artifact_url"].endswith(f"/v1/artifacts/{first['artifact_key']}")
    assert published[1]["sdk"] == "2.14.0"  # the campaign's new artifact
    (failed,) = [e["build"] for e in got if e["type"] == "build.failed"]
    assert failed["id"] == failing["build_id"]
    (finished,) = [e["campaign"] for e in got if e["type"] == "campaign.finished"]
    assert finished["id"] == campaign["id"] and finished["progress"]["built"] == 1
    assert finished["new_artifact_keys"] == [published[1]["key"]]

    listed = env.client.get("/v1/subscriptions").json["items"]
    assert {s["event"]: [d["state"] for d in s["recent_deliveries"]] for s in listed} == {
        "artifact.published": ["delivered", "delivered"], "build.failed": ["delivered"],
        "campaign.finished": ["delivered"]}
    removed = env.client.delete(f"/v1/subscriptions/{listed[1]['id']}")
    assert removed.status_code == 200
    assert_problem(env.client.delete(f"/v1/subscriptions/{listed[1]['id']}"), 404, "subscription-not-found")


def test_a_url_the_service_must_not_call_is_refused(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)  # no networks allowed
    body = assert_problem(env.client.post("/v1/subscriptions", json={"url": "http://127.0.0.1:9/x",
                                                                       "event": "artifact.published"}),
                          422, "subscription-invalid")
    assert "loopback" in body["detail"]
    assert_problem(env.client.post("/v1/subscriptions", json={"url": "http://93.184.216.34/x", "event": "nope"}),
                   422, "subscription-invalid")
