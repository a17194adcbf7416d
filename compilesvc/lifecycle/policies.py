"""Standing roll-forward policies: a campaign (:mod:`compilesvc.lifecycle.campaigns`) that starts by itself
when the first worker of a new SDK release registers, so the fleet's artifacts for that release exist
before serving moves to it.

A release is *new* for a target when no worker ever registered with it for that target: the
``sdk_releases`` table holds every (target, release) seen, and the registration that inserts the row (an
insert that ignores conflicts, in the registration's transaction: :func:`claim`) is the first. For that
release, each enabled policy covering the target claims a run, unique per (policy, release): with several
workers of the release registering at once on several hosts, one of them claims it, once. A policy without
a target covers the Neuron targets (a cpu worker's release is its torch: a policy for it says ``cpu``).
After commit the claimer starts the campaign (:func:`start_claimed`), from the policy's ``from_sdk`` or,
when it names none, from the newest older release (by version) with published artifacts for the target.

A claimed run whose campaign never started because its worker died in between (no campaign, no note) is
started by the relay once :data:`START_GRACE_SECONDS` have passed (:func:`start_stalled`), if its policy is
still enabled and the run is younger than :data:`MAX_START_AGE_SECONDS`; a campaign whose starter died while
submitting its items (the worker, or the API's enable request) has the rest submitted by the relay, each item
once (a claim the ledger decides: :func:`compilesvc.lifecycle.campaigns.submit_items`); a run that could
not start (no source release, a failed start) says so in its ``note``, and an operator starts that roll-forward
by hand (``compilesvc rollforward``). At most one campaign exists per run, whoever starts it: migration 0020's
unique index on a campaign's (policy, release), so a relay and a slow worker, or two relays, racing to start
the same run end with one campaign, which the run then names.

A policy enabled again (:func:`catch_up`) runs for the releases it missed while disabled: those first seen
after it was created, that a live worker serves now, and that it has no run for, as if it had been enabled
when their first worker registered. Releases no live worker serves any more are history (the fleet moved
on), and a policy created now fires from the next release on, as before.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.dispatch.registry import live_workers
from compilesvc.ledger.campaigns import Campaign, PolicyRun, RollforwardPolicy, SdkRelease
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, utcnow
from compilesvc.ledger.sql import insert_ignore, insert_ignore_duplicate
from compilesvc.lifecycle import campaigns
from compilesvc.spec.neuron_releases import version_tuple
from compilesvc.states import ArtifactState

log = logging.getLogger(__name__)

NEURON_TARGETS = ("inf2", "trn1", "trn2")
TARGETS = (*NEURON_TARGETS, "cpu")
NAME_MAX = 64
NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{NAME_MAX}}}")  # the API's schema says the same
#: How long a claimed run may go without a campaign before the relay starts it: its worker submits the
#: campaign right after registering (the campaign's row exists within seconds), so a run this old with no
#: campaign and no note lost its worker. The unique index makes a late start harmless anyway.
START_GRACE_SECONDS = 300.0
#: The oldest run (or policy campaign) the relay starts (or resumes). The relay passes every few minutes, so
#: one it did not start within a day predates it (a ledger upgraded from a release without the relay holds
#: runs nobody started) or outlived a long outage: the fleet has served that release for a day without the
#: roll-forward, and queueing a fleet's worth of compiles nobody is watching for is an operator's call
#: (``compilesvc rollforward``), not the relay's.
MAX_START_AGE_SECONDS = 86400.0


class PolicyError(ValueError):
    """A policy that cannot be stored: ``field`` names the bad input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class PolicyExists(PolicyError):
    """A policy has that name already."""


@dataclass(frozen=True)
class Claim:
    """A policy run this registration claimed: start its campaign after commit."""

    run_id: int
    policy_id: int
    target: str
    to_sdk: str


def releases_of(capabilities: dict[str, Any]) -> list[tuple[str, str]]:
    """The (target, release) pairs a worker's capabilities serve (a cpu worker's release is its torch)."""
    sdk = capabilities.get("sdk") or {}
    return sorted((target, str(sdk[target])) for target in capabilities.get("targets") or [] if sdk.get(target))


def add(session: Session, *, name: str, target: str | None = None, from_sdk: str | None = None,
        model: str | None = None, labels: dict[str, str] | None = None, pinned: bool = False,
        fetched_within_days: float | None = None, enabled: bool = True,
        created_by: str | None = None) -> RollforwardPolicy:
    """Store a policy; :class:`PolicyError` for a bad field or a name already taken."""
    if not NAME.fullmatch(name):
        raise PolicyError("name", f"1 to {NAME_MAX} letters, digits, '-', '_' or '.'")
    if target is not None and target not in TARGETS:
        raise PolicyError("target", f"one of {', '.join(TARGETS)}")
    if fetched_within_days is not None and fetched_within_days <= 0:
        raise PolicyError("fetched_within_days", "a number of days above 0")
    if session.scalar(select(RollforwardPolicy.id).where(RollforwardPolicy.name == name)) is not None:
        raise PolicyExists("name", f"a policy named {name!r} exists")
    policy = RollforwardPolicy(name=name, target=target, from_sdk=from_sdk, model=model, labels=dict(labels or {}),
                               pinned=pinned, fetched_within_days=fetched_within_days, enabled=enabled,
                               created_by=created_by)
    session.add(policy)
    session.flush()
    return policy


def find(session: Session, name_or_id: str) -> RollforwardPolicy | None:
    """By name, else (digits) by id: a policy may be named "7"."""
    found = session.scalars(select(RollforwardPolicy).where(RollforwardPolicy.name == name_or_id)).first()
    if found is None and name_or_id.isascii() and name_or_id.isdigit() and int(name_or_id) < 2**63:
        found = session.get(RollforwardPolicy, int(name_or_id))
    return found


def runs_of(session: Session, policy_id: int) -> list[PolicyRun]:
    return list(session.scalars(select(PolicyRun).where(PolicyRun.policy_id == policy_id)
                                .order_by(PolicyRun.id.desc())))


def _covers(target: str) -> Any:
    covers = RollforwardPolicy.target == target
    return covers | RollforwardPolicy.target.is_(None) if target in NEURON_TARGETS else covers


def _claim_run(session: Session, policy_id: int, target: str, sdk: str, worker_id: str) -> Claim | None:
    run_id = insert_ignore(session, PolicyRun, {"policy_id": policy_id, "to_sdk": sdk, "target": target,
                                                "worker_id": worker_id, "created_at": utcnow()},
                           ["policy_id", "to_sdk"])
    return Claim(run_id, policy_id, target, sdk) if run_id is not None else None


def claim(session: Session, worker_id: str, capabilities: dict[str, Any]) -> list[Claim]:
    """In the transaction registering ``worker_id``: the releases it is the first to serve, and for each, a
    run of every enabled policy covering its target that no one claimed yet."""
    claims: list[Claim] = []
    for target, sdk in releases_of(capabilities):
        if not insert_ignore_duplicate(session, SdkRelease, {"target": target, "sdk": sdk,
                                                             "first_worker_id": worker_id,
                                                             "first_seen_at": utcnow()}, ["target", "sdk"]):
            continue  # some worker served it before (or is registering it now, and is first)
        log.info("a new SDK release registered", extra={"target": target, "sdk": sdk, "worker": worker_id})
        policies = session.scalars(select(RollforwardPolicy).where(RollforwardPolicy.enabled.is_(True),
                                                                   _covers(target)).order_by(RollforwardPolicy.id))
        for policy in policies:
            if (claimed := _claim_run(session, policy.id, target, sdk, worker_id)) is not None:
                claims.append(claimed)
    return claims


def catch_up(session: Session, policy: RollforwardPolicy, stale_seconds: int, by: str) -> list[Claim]:
    """In the transaction enabling ``policy``: a run for each release it missed while disabled (first seen
    after the policy was created, served by a live worker now, of a target it covers, with no run of it)."""
    serving: set[tuple[str, str]] = set()
    for worker in live_workers(session, stale_seconds):
        serving.update(releases_of(worker.capabilities or {}))
    claims: list[Claim] = []
    missed = session.scalars(select(SdkRelease).where(SdkRelease.first_seen_at >= policy.created_at)
                             .order_by(SdkRelease.first_seen_at))
    for release in missed:
        covered = release.target == policy.target or (policy.target is None and release.target in NEURON_TARGETS)
        if not covered or (release.target, release.sdk) not in serving:
            continue
        if (claimed := _claim_run(session, policy.id, release.target, release.sdk, by)) is not None:
            claims.append(claimed)
    return claims


def stalled(session: Session, grace_seconds: float = START_GRACE_SECONDS,
            max_age_seconds: float = MAX_START_AGE_SECONDS) -> list[Claim]:
    """Runs of enabled policies claimed between ``grace_seconds`` and ``max_age_seconds`` ago with neither a
    campaign nor a note: their starter died. (A policy disabled since its run was claimed starts nothing.)"""
    now = utcnow()
    runs = session.scalars(select(PolicyRun).join(RollforwardPolicy, RollforwardPolicy.id == PolicyRun.policy_id)
                           .where(PolicyRun.campaign_id.is_(None), PolicyRun.note.is_(None),
                                  RollforwardPolicy.enabled.is_(True),
                                  PolicyRun.created_at < now - timedelta(seconds=grace_seconds),
                                  PolicyRun.created_at >= now - timedelta(seconds=max_age_seconds))
                           .order_by(PolicyRun.id))
    return [Claim(run.id, run.policy_id, run.target, run.to_sdk) for run in runs]


def half_submitted(session: Session, grace_seconds: float = START_GRACE_SECONDS,
                   max_age_seconds: float = MAX_START_AGE_SECONDS) -> list[int]:
    """Running campaigns of enabled policies, created between ``grace_seconds`` and ``max_age_seconds`` ago,
    with an item nobody submitted or is submitting: their starter died mid-loop."""
    return list(session.scalars(campaigns.resumable(grace_seconds, max_age_seconds)
                                .join(RollforwardPolicy, RollforwardPolicy.id == Campaign.policy_id)
                                .where(RollforwardPolicy.enabled.is_(True))))


def start_stalled(sessions: sessionmaker[Session], submit: campaigns.SubmitDocument,
                  grace_seconds: float = START_GRACE_SECONDS,
                  max_age_seconds: float = MAX_START_AGE_SECONDS) -> list[int]:
    """The relay's pass: start every stalled run's campaign (or name the one that exists), then submit the
    items a dead starter did not reach in policy campaigns (each once, however many relays run); the ids of
    the campaigns started, named or resumed."""
    with sessions() as session:
        found = stalled(session, grace_seconds, max_age_seconds)
    started = []
    for claimed in found:
        log.warning("a policy run has no campaign: starting it", extra={"run_id": claimed.run_id,
                                                                         "policy_id": claimed.policy_id})
        if (campaign_id := start_claimed(sessions, claimed, submit)) is not None:
            started.append(campaign_id)
    with sessions() as session:
        resumable = half_submitted(session, grace_seconds, max_age_seconds)
    for campaign_id in resumable:
        log.warning("a policy campaign has items nobody submitted: submitting them",
                    extra={"campaign_id": campaign_id})
        if campaigns.submit_items(sessions, campaign_id, submit) and campaign_id not in started:
            started.append(campaign_id)
    return started


def _existing_campaign(session: Session, claimed: Claim) -> Campaign | None:
    return session.scalars(select(Campaign).where(Campaign.policy_id == claimed.policy_id,
                                                  Campaign.to_sdk == claimed.to_sdk)).first()


def _link(sessions: sessionmaker[Session], claimed: Claim) -> int | None:
    """Name the campaign another process started for this run (None: there is none)."""
    with transaction(sessions) as session:
        campaign = _existing_campaign(session, claimed)
        run = session.get(PolicyRun, claimed.run_id)
        if campaign is None or run is None:
            return None
        run.from_sdk, run.campaign_id = campaign.from_sdk, campaign.id
        return campaign.id


def source_release(session: Session, policy: RollforwardPolicy, target: str, to_sdk: str) -> str | None:
    """The policy's ``from_sdk``, or the newest release older than ``to_sdk`` (by version number) with
    published artifacts of the policy's target (of a Neuron target, for a policy without one)."""
    if policy.from_sdk:
        return policy.from_sdk
    targets = [policy.target] if policy.target else list(NEURON_TARGETS)
    sdks = session.scalars(select(Artifact.sdk).distinct().where(Artifact.state == ArtifactState.PUBLISHED,
                                                                 Artifact.target.in_(targets)))
    older = [(version_tuple(sdk), sdk) for sdk in sdks if version_tuple(sdk) < version_tuple(to_sdk)]
    return max(older)[1] if older else None


def start_claimed(sessions: sessionmaker[Session], claimed: Claim, submit: campaigns.SubmitDocument) -> int | None:
    """Start the campaign of a claimed run (after the claim committed); its id, or None with the run's note
    saying why not."""
    if (existing := _link(sessions, claimed)) is not None:  # started already (a relay after a slow worker)
        return existing
    with sessions() as session:
        policy = session.get(RollforwardPolicy, claimed.policy_id)
        if policy is None:
            return None
        from_sdk = source_release(session, policy, claimed.target, claimed.to_sdk)
        selection = campaigns.Selection(from_sdk or "", claimed.to_sdk, policy.model, policy.target,
                                        dict(policy.labels), policy.pinned, policy.fetched_within_days)
    if from_sdk is None or from_sdk == claimed.to_sdk:
        _note(sessions, claimed.run_id, None, f"no older release has published {policy.target or claimed.target} "
                                            f"artifacts to move to {claimed.to_sdk}")
        return None
    try:
        campaign_id = campaigns.start(sessions, selection, submit, None, policy_id=claimed.policy_id,
                                      queue_anyway=True)
    except IntegrityError:  # another process created this run's campaign meanwhile (the unique index)
        return _link(sessions, claimed)
    except Exception as exc:  # the worker still starts; the run says what to do by hand
        log.exception("a policy's campaign did not start", extra={"policy_id": claimed.policy_id})
        _note(sessions, claimed.run_id, from_sdk, f"the campaign did not start ({type(exc).__name__}: {exc}); "
                                                  f"run `compilesvc rollforward --from-sdk {from_sdk} "
                                                  f"--to-sdk {claimed.to_sdk}`")
        return None
    with transaction(sessions) as session:
        run = session.get_one(PolicyRun, claimed.run_id)
        run.from_sdk, run.campaign_id = from_sdk, campaign_id
    log.info("a policy started a campaign", extra={"policy_id": claimed.policy_id, "campaign_id": campaign_id,
                                                   "from_sdk": from_sdk, "to_sdk": claimed.to_sdk})
    return campaign_id


def _note(sessions: sessionmaker[Session], run_id: int, from_sdk: str | None, note: str) -> None:
    with transaction(sessions) as session:
        run = session.get_one(PolicyRun, run_id)
        run.from_sdk, run.note = from_sdk, note


def campaigns_of(session: Session, policy_id: int) -> list[Campaign]:
    return list(session.scalars(select(Campaign).where(Campaign.policy_id == policy_id).order_by(Campaign.id.desc())))
