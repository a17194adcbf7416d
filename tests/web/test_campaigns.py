"""Roll-forward campaigns through the API on both ledgers: what is selected, the dry run, progress as the
new release's builds end (built, hit, failed with the compiler's error), finishing, reopening on retry."""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy import func, select

from compilesvc.ledger.models import Build
from tests.web.support import Env, complete_build, fail_build, spec_for
from tests.web.test_submit import assert_problem


def publish(env: Env, model: bytes, **spec: Any) -> dict[str, Any]:
    build = env.submit(spec_for(env.upload(model), **spec)).json
    complete_build(env.services, build["build_id"])
    return dict(build)


def rollforward(env: Env, **body: Any) -> Any:
    return env.client.post("/v1/campaigns/rollforward", json={"from_sdk": "2.13.0", "to_sdk": "2.14.0", **body})


def build_count(env: Env) -> int:
    with env.services.sessions() as session:
        return session.scalar(select(func.count()).select_from(Build)) or 0


def test_a_rollforward_moves_what_it_selects_and_finishes_when_every_build_ends(env: Env) -> None:
    a = publish(env, b"model a", labels={"team": "search"})
    b = publish(env, b"model b", labels={"team": "search"}, buckets=((4, 8),))
    c = publish(env, b"model c", name="other-model")
    publish(env, b"model d", sdk="2.12.0")  # another release: not selected
    env.submit(spec_for(env.upload(b"model e")))  # 2.13.0 but still building: nothing to move yet
    sources = {a["artifact_key"], b["artifact_key"], c["artifact_key"]}

    before = build_count(env)
    plan = rollforward(env, dry_run=True)
    assert plan.status_code == 200, plan.json
    assert {i["source_key"] for i in plan.json["items"]} == sources
    assert {i["state"] for i in plan.json["items"]} == {"absent"} and all(i["key"] for i in plan.json["items"])
    assert build_count(env) == before  # a dry run submits nothing
    assert {i["source_key"] for i in rollforward(env, dry_run=True, model="other-model").json["items"]} == {
        c["artifact_key"]}
    assert {i["source_key"] for i in rollforward(env, dry_run=True, labels={"team": "search"}).json["items"]} == {
        a["artifact_key"], b["artifact_key"]}

    started = rollforward(env, queue_anyway=True)  # no worker serves 2.14.0 in this environment
    assert started.status_code == 201, started.json
    campaign = started.json
    assert started.headers["Location"] == campaign["url"]
    assert campaign["state"] == "running" and campaign["progress"]["total"] == 3
    assert campaign["progress"]["building"] == 3 and campaign["progress"]["submitted"] == 3
    new_keys = {i["artifact_key"] for i in campaign["items"]}
    assert new_keys == {i["key"] for i in plan.json["items"]}  # the dry run named the keys it then built
    for item in campaign["items"]:
        detail = env.client.get(f"/v1/builds/{item['build_id']}").json
        assert detail["spec"]["sdk"] == "2.14.0" and detail["labels"]["campaign"] == str(campaign["id"])

    by_source = {i["source_key"]: i for i in campaign["items"]}
    complete_build(env.services, by_source[a["artifact_key"]]["build_id"])
    complete_build(env.services, by_source[b["artifact_key"]]["build_id"])
    url = f"/v1/campaigns/{campaign['id']}"
    assert env.client.get(url).json["state"] == "running"
    fail_build(env.services, by_source[c["artifact_key"]]["build_id"], code="NCC_EVRF009",
               message="the new release does not support this operator")

    done = env.client.get(url).json
    assert done["state"] == "finished" and done["finished_at"] is not None
    assert {k: done["progress"][k] for k in ("built", "hit", "failed", "building", "refused")} == {
        "built": 2, "hit": 0, "failed": 1, "building": 0, "refused": 0}
    (failure,) = done["failures"]
    assert failure["source_key"] == c["artifact_key"] and failure["error_code"] == "NCC_EVRF009"
    assert "does not support this operator" in failure["error_message"]
    assert [c["id"] for c in env.client.get("/v1/campaigns").json["items"]] == [campaign["id"]]

    # A retry of the failed build reopens the campaign; its end finishes it again.
    retried = env.client.post(f"/v1/builds/{failure['build_id']}/retry")
    assert retried.status_code == 202, retried.json
    assert env.client.get(url).json["state"] == "running"
    complete_build(env.services, failure["build_id"])
    again = env.client.get(url).json
    assert again["state"] == "finished" and again["progress"]["built"] == 3


def test_artifacts_existing_for_the_new_release_are_hits_and_finish_at_once(env: Env) -> None:
    moved = publish(env, b"model a")
    uri = env.client.get(f"/v1/builds/{moved['build_id']}").json["spec"]["model"]["uri"]
    publish_new = env.submit(spec_for(uri, sdk="2.14.0")).json
    complete_build(env.services, publish_new["build_id"])
    campaign = rollforward(env).json  # a hit needs no worker
    assert campaign["state"] == "finished"
    assert campaign["progress"]["hit"] == 1 and campaign["items"][0]["outcome"] == "hit"


def test_a_release_no_worker_serves_is_a_refusal_per_item(env: Env) -> None:
    moved = publish(env, b"model a")
    campaign = rollforward(env).json
    assert campaign["state"] == "finished" and campaign["progress"]["refused"] == 1
    (refusal,) = campaign["refusals"]
    assert refusal["source_key"] == moved["artifact_key"] and "no live worker serves" in refusal["refusal"]
    assert campaign["items"][0]["build_id"] is None


def test_nothing_to_move_and_bad_requests(env: Env) -> None:
    empty = rollforward(env, from_sdk="1.0.0")
    assert empty.status_code == 201 and empty.json["state"] == "finished" and empty.json["progress"]["total"] == 0
    assert_problem(rollforward(env, to_sdk="2.13.0"), 422, "campaign-invalid")
    assert_problem(rollforward(env, to_sdk="2.14"), 422, "campaign-invalid")
    assert_problem(rollforward(env, target="tpu"), 422, "campaign-invalid")
    assert_problem(env.client.get("/v1/campaigns/999"), 404, "campaign-not-found")


def test_only_what_fleets_load_pinned_or_fetched_lately(env: Env) -> None:
    pinned = publish(env, b"pinned model")
    fetched = publish(env, b"fetched model")
    publish(env, b"neither")
    assert env.client.post("/v1/pins", json={"kind": "artifact", "value": pinned["artifact_key"]}).status_code == 201
    assert env.client.get(f"/v1/artifacts/{fetched['artifact_key']}").status_code == 200
    env.app.extensions["compilesvc"].fetches.flush()

    def sources(**body: Any) -> set[str]:
        return {i["source_key"] for i in rollforward(env, dry_run=True, **body).json["items"]}

    assert sources(pinned=True) == {pinned["artifact_key"]}
    assert sources(fetched_within_days=1) == {fetched["artifact_key"]}
    assert sources(pinned=True, fetched_within_days=1) == set()
    assert len(sources()) == 3


def test_a_label_pin_holding_nul_is_refused_as_the_document_says(sqlite_env: Env) -> None:
    """Found by the conformance fuzz (admin, positive mode): the document allowed a NUL in a label pin's
    value, which the JSON reader refuses everywhere; now the pattern says so too. The exact request:"""
    env = sqlite_env
    body = '{"kind": "label", "value": "B(\\u0010*\\u00d0\\u001aY\\u001f\\u00cb\\u0000\\ud8e9\\udd2b\\u1dc4:"}'
    response = env.client.post("/v1/pins", data=body, content_type="application/json")
    assert assert_problem(response, 422, "pin-invalid")["errors"][0]["field"] == "value"
    pattern = env.client.get("/openapi.json").json["components"]["schemas"]["LabelPinIn"]["properties"]["value"][
        "pattern"]
    value = json.loads(body)["value"]
    assert re.search(pattern, value) is None and re.search(pattern, value.replace("\x00", " "))
    made = env.client.post("/v1/pins", json={"kind": "label", "value": value.replace("\x00", " ")})
    assert made.status_code == 201


def test_a_rollforward_body_is_read_as_its_schema_says(sqlite_env: Env) -> None:
    """Found by the conformance fuzz (admin, negative mode): ``"queue_anyway": 0`` started a campaign, read
    as false by lax validation, though the document says a boolean. The exact request, then its kin."""
    env = sqlite_env
    fuzzed = ('{"from_sdk": "3.65930718.32208690", "queue_anyway": 0, "to_sdk": "0.481.0", "dry_run": false, '
              '"pinned": false, "target": null}')
    response = env.client.post("/v1/campaigns/rollforward", data=fuzzed, content_type="application/json")
    assert [e["field"] for e in assert_problem(response, 422, "campaign-invalid")["errors"]] == ["queue_anyway"]
    for field, value in (("dry_run", "yes"), ("pinned", 1), ("fetched_within_days", "1.5"),
                         ("fetched_within_days", True)):
        assert_problem(rollforward(env, from_sdk="1.0.0", **{field: value}), 422, "campaign-invalid")
    assert rollforward(env, from_sdk="1.0.0", fetched_within_days=2, dry_run=True).status_code == 200
