"""A standing roll-forward policy starts its campaign by itself: artifacts built by a worker of one Neuron
release (the SDK double), a policy, then the first worker of the next release registers, and the
campaign is queued, compiled by that worker and published, with ``campaign.started`` for subscribers; a
second worker of that release starts nothing more."""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlalchemy import select

from compilesvc.ledger.campaigns import Campaign, PolicyRun, SdkRelease
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import BucketCompile
from compilesvc.ledger.webhooks import EventSubscription, WebhookDelivery
from compilesvc.lifecycle import campaigns, policies
from compilesvc.notify import webhooks
from tests.doubles import neuron_double_env
from tests.fixtures.waiting import wait_for
from tests.workers.conftest import NEURON_SDK, Cluster

MakeCluster = Callable[..., Cluster]
NEXT_SDK = "2.25.0"


def test_the_first_worker_of_a_new_release_starts_the_policys_campaign(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.start_worker("w-old", concurrency=2)  # the cluster's environment: the double as NEURON_SDK
    uri = cluster.upload(b"HloModuleProto policy", "model.hlo.pb")
    moved = cluster.submit(cluster.hlo_spec("ok", buckets=2, uri=uri, labels={"fleet": "search"}))
    kept = cluster.submit(cluster.hlo_spec("ok", buckets=1, uri=uri, labels={"fleet": "batch"}))
    for key in (moved.artifact_key, kept.artifact_key):
        cluster.wait_artifact(key, ("published",), timeout=60)
    with transaction(cluster.services.sessions) as session:
        assert session.get(SdkRelease, ("inf2", NEURON_SDK)).first_worker_id == "w-old@test"
        policy_id = policies.add(session, name="search-fleet", labels={"fleet": "search"}).id  # from_sdk: newest older
        session.add(EventSubscription(url="https://deploy.example/hooks", event="campaign.started"))

    cluster.start_worker("w-new", concurrency=2, env=neuron_double_env(cluster.env, sdk=NEXT_SDK))

    def campaign_of_policy() -> Campaign | None:
        with cluster.services.sessions() as session:
            return session.scalars(select(Campaign).where(Campaign.policy_id == policy_id)).first()

    campaign = wait_for(campaign_of_policy, timeout=30, what="the policy's campaign")
    assert (campaign.from_sdk, campaign.to_sdk) == (NEURON_SDK, NEXT_SDK)

    def finished() -> Campaign | None:
        found = campaign_of_policy()
        return found if found is not None and found.state == "finished" else None

    wait_for(finished, timeout=90, what="the policy's campaign to finish")
    with cluster.services.sessions() as session:
        done = session.get_one(Campaign, campaign.id)
        progress = campaigns.progress(session, done)
        runs = session.scalars(select(PolicyRun).where(PolicyRun.policy_id == policy_id)).all()
        new_buckets = session.scalars(select(BucketCompile).where(BucketCompile.sdk == NEXT_SDK)).all()
        delivery = session.scalars(select(WebhookDelivery).where(WebhookDelivery.event == "campaign.started")).one()
        document = json.loads(webhooks.payload(session, delivery, "https://compilesvc.example"))
    assert (progress.total, progress.built, progress.failed, progress.refused) == (1, 1, 0, 0)  # not "batch"
    assert [i["source_key"] for i in progress.items] == [moved.artifact_key]
    new_key = progress.items[0]["artifact_key"]
    artifact = cluster.artifact(new_key)
    assert artifact.state == "published" and artifact.sdk == NEXT_SDK
    assert len(new_buckets) == 2 and {b.worker_id for b in new_buckets} == {"w-new@test"}
    assert [(r.to_sdk, r.target, r.worker_id, r.from_sdk, r.campaign_id, r.note) for r in runs] == [
        (NEXT_SDK, "inf2", "w-new@test", NEURON_SDK, campaign.id, None)]
    assert delivery.subject_id == campaign.id
    assert document["type"] == "campaign.started" and document["campaign"]["policy"] == "search-fleet"

    # Another worker of the release: not the first, so nothing starts again.
    cluster.start_worker("w-new-2", concurrency=1, env=neuron_double_env(cluster.env, sdk=NEXT_SDK))
    with cluster.services.sessions() as session:
        assert session.scalars(select(Campaign.id).where(Campaign.policy_id == policy_id)).all() == [campaign.id]
        assert session.get_one(SdkRelease, ("inf2", NEXT_SDK)).first_worker_id == "w-new@test"
