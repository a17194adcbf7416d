"""A standing roll-forward policy starts its campaign by itself: artifacts built by a worker of one Neuron
release (the SDK double), a policy, then the first worker of the next release registers, and the
campaign is queued, compiled by that worker and published, with ``campaign.started`` for subscribers; a
second worker of that release starts nothing more. And the policies' command line against a running API."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable

from sqlalchemy import select

from compilesvc.ledger.campaigns import Campaign, PolicyRun, SdkRelease
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import BucketCompile
from compilesvc.ledger.webhooks import EventSubscription, WebhookDelivery
from compilesvc.lifecycle import campaigns, policies
from compilesvc.notify import webhooks
from tests.doubles import neuron_double_env
from tests.fixtures.ports import free_port
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.fixtures.waiting import wait_for
from tests.workers.conftest import COMPILESVC, NEURON_SDK, Cluster

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


def policies_cli(api: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``compilesvc rollforward-policies`` as a person runs it (through the CLI's main: one-line errors)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_"))}
    env.update({"COMPILESVC_API_URL": api, "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN,
                "COMPILESVC_CONFIG": "/nonexistent/compilesvc.toml"})
    return subprocess.run([COMPILESVC, "rollforward-policies", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_policies_from_the_command_line(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    port = free_port()
    cluster.start_api(port, workers=1)
    api = f"http://127.0.0.1:{port}"

    made = policies_cli(api, "add", "search", "--target", "inf2", "--label", "fleet=search", "--from-sdk", "2.24.0")
    assert made.returncode == 0 and made.stdout.strip().isdigit(), made.stderr
    listed = policies_cli(api, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split("\t")[1:4] == ["search", "enabled", "target=inf2 from=2.24.0 label:fleet=search"]
    assert "not fired yet" in listed.stdout
    assert json.loads(policies_cli(api, "list", "--json").stdout)["items"][0]["labels"] == {"fleet": "search"}

    for argv, words in ((["add", "search"], "rollforward-policies remove"),
                        (["add", "other", "--from-sdk", "2.24"], "from_sdk"),
                        (["remove", "nobody"], "rollforward-policies list"),
                        (["add", "x", "--label", "novalue"], "NAME=VALUE")):
        refused = policies_cli(api, *argv)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, refused.stderr)
        assert words in lines[0], (argv, lines[0])

    assert policies_cli(api, "disable", "search").returncode == 0
    assert "\tsearch\tdisabled\t" in policies_cli(api, "list").stdout
    assert policies_cli(api, "enable", "search").returncode == 0
    assert "\tsearch\tenabled\t" in policies_cli(api, "list").stdout
    removed = policies_cli(api, "remove", "search")
    assert removed.returncode == 0 and "removed search" in removed.stderr, removed.stderr
    assert policies_cli(api, "list").stdout == ""
