"""Campaigns: an operator moving a fleet's artifacts from one SDK release to another before the switch.

A roll-forward selects every published artifact of ``from_sdk`` (narrowed by model name, labels, target,
and optionally to the pinned ones or those fetched lately: what fleets load)
and submits, for each, the spec of its newest matching build with ``sdk`` set to ``to_sdk``: the same
model bytes (the artifact's own pin of its model is reused, :attr:`Candidate.model`: an S3 object's or an S3
prefix's versions, not what the URI holds today), shapes and flags, compiled for the new release (the spec
validated against it: an NxDI NeuronConfig field the new release's NxD Inference lacks is that item's refusal;
the key computed with its toolchain). Each submit is an ordinary one (hit, join or
new; compiled by the new release's workers) and its build is linked to the campaign as an item; a spec
the new release refuses (a flag it no longer has, a model that is gone) is an item with its refusal.

The campaign is ``finished`` when every item's build has ended (or its submit was refused): the build
transition that ends the last one finishes it, in the same transaction (:func:`on_build_transition`,
a subscriber of :mod:`compilesvc.ledger.events`), under a lock on the campaign row, so two builds ending at
once cannot both miss it. A retried build reopens a finished campaign. :func:`progress` counts what was
built, hit, failed (with the compiler's error) and refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import Select, and_, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.access.tokens import Principal
from compilesvc.ledger import events
from compilesvc.ledger.campaigns import Campaign, CampaignItem
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, BuildLabel, utcnow
from compilesvc.lifecycle import retention
from compilesvc.pinning.pins import ModelPinning, ModelRefError, PinnedModel
from compilesvc.refusals import SubmitRefused
from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.parsing import SpecError
from compilesvc.states import ArtifactState, BucketState, BuildState, CampaignState, Outcome

log = logging.getLogger(__name__)

ROLLFORWARD = "rollforward"
#: The label every build of a campaign carries, so history filters find them (``label=campaign:<id>``).
CAMPAIGN_LABEL = "campaign"
ENDED = frozenset({BuildState.SUCCEEDED, BuildState.FAILED, BuildState.CANCELLED})
#: How long a claim on an item's submit (:func:`_claim_item`) holds before another starter may take it: one
#: submit pins the model (an hf-checkpoint archive in S3 is read whole the first time: minutes for GBs) and
#: writes a few rows, so a claim this old lost its claimer. Taking it over may submit the item twice (the
#: claimer died after its build committed, before naming it): a join of the same artifact, not a second compile.
CLAIM_SECONDS = 1800.0


@dataclass(frozen=True)
class Selection:
    """Which artifacts a roll-forward moves: those published for ``from_sdk``, optionally of one model
    name, target and set of labels (every one must match a build of the artifact)."""

    from_sdk: str
    to_sdk: str
    model: str | None = None
    target: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    pinned: bool = False  # only artifacts a retention pin keeps
    fetched_within_days: float | None = None  # only artifacts fetched by key this recently

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "labels": dict(self.labels), "pinned": self.pinned,
                "fetched_within_days": self.fetched_within_days}


@dataclass(frozen=True)
class Candidate:
    """An artifact to move, and the build whose spec is resubmitted for the new release."""

    artifact_key: str
    build_id: int
    model_name: str | None
    target: str
    spec: dict[str, Any]
    #: The artifact's pin of its model (its first compile's), resubmitted with the spec; None for a ledger row
    #: without one (then the spec's URI is pinned again).
    model: PinnedModel | None = None
    #: The team of the build whose spec is resubmitted: the model is checked against its model sources again
    #: (:mod:`compilesvc.pinning.model_sources`), whoever starts the campaign.
    team: str | None = None


def _first_compile_model(session: Session, artifact_keys: list[str]) -> dict[str, tuple[dict[str, Any], Any]]:
    """Each artifact's model pin, from its first bucket's compile (every compile of an artifact has its pin),
    and the artifact's key material (for a checkpoint: what the key read from it, which the pin row lacks)."""
    if not artifact_keys:
        return {}
    first = (select(ArtifactBucket.artifact_id, func.min(ArtifactBucket.position).label("position"))
             .group_by(ArtifactBucket.artifact_id).subquery())
    rows = session.execute(
        select(Artifact.key, BucketCompile.model, Artifact.material)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == Artifact.id)
        .join(first, and_(first.c.artifact_id == ArtifactBucket.artifact_id,
                          first.c.position == ArtifactBucket.position))
        .join(BucketCompile, BucketCompile.id == ArtifactBucket.bucket_compile_id)
        .where(Artifact.key.in_(artifact_keys))
    ).all()
    return {row.key: (dict(row.model), row.material) for row in rows if row.model}


def _pin_of(spec: dict[str, Any], source: tuple[dict[str, Any], Any] | None) -> PinnedModel | None:
    """The pin to resubmit ``spec`` with: the source's, when it is a pin of the spec's model. A checkpoint's pin
    gets back what its key read (config.json, weight digests) from the artifact's material (``model``: the
    canonical config, which keys the same); without it the URI is pinned again."""
    if source is None:
        return None
    model, material = source
    try:
        pinned = PinnedModel.from_json(model)
        if pinned.format == "hf-checkpoint":
            pinned = replace(pinned, checkpoint=CheckpointMaterial.from_json(material["model"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # a ledger row of another shape: pin the URI again
    wanted = spec.get("model") or {}
    return pinned if (pinned.uri, pinned.format) == (wanted.get("uri"), wanted.get("format")) else None


def candidates(session: Session, selection: Selection) -> list[Candidate]:
    """The artifacts ``selection`` picks, oldest first, each with its newest matching build."""
    matching = (select(func.max(Build.id).label("build_id"))
                .join(Artifact, Artifact.id == Build.artifact_id)
                .where(Artifact.state == ArtifactState.PUBLISHED, Artifact.sdk == selection.from_sdk))
    if selection.target:
        matching = matching.where(Artifact.target == selection.target)
    if selection.pinned:
        matching = matching.where(retention.pinned())
    if selection.fetched_within_days is not None:
        matching = matching.where(Artifact.last_fetched_at >= utcnow() - timedelta(days=selection.fetched_within_days))
    if selection.model:
        matching = matching.where(Build.model_name == selection.model)
    for name, value in sorted(selection.labels.items()):
        label = select(BuildLabel.build_id).where(BuildLabel.build_id == Build.id, BuildLabel.name == name,
                                                  BuildLabel.value == value)
        matching = matching.where(label.exists())
    newest = matching.group_by(Build.artifact_id).subquery()
    rows = session.execute(
        select(Build.id, Build.artifact_key, Build.model_name, Build.target, Build.spec, Build.team)
        .join(newest, newest.c.build_id == Build.id).order_by(Build.artifact_id)
    ).all()
    models = _first_compile_model(session, [row.artifact_key for row in rows])
    return [Candidate(row.artifact_key, row.id, row.model_name, row.target, dict(row.spec),
                      _pin_of(dict(row.spec), models.get(row.artifact_key)), row.team) for row in rows]


def rolled_spec(spec: dict[str, Any], to_sdk: str, campaign_id: int | None) -> dict[str, Any]:
    """The spec for the new release: ``sdk`` replaced, its callbacks dropped (the campaign notifies), and
    labelled with the campaign."""
    document = {k: v for k, v in spec.items() if k != "callbacks"}
    document["sdk"] = to_sdk
    if campaign_id is not None:
        document["labels"] = {**(spec.get("labels") or {}), CAMPAIGN_LABEL: str(campaign_id)}
    return document


#: Submits one spec document for a campaign (parsed with the service's limits and flags, its model the given
#: pin when there is one (``Submitter.prepare(spec, reuse=..., team=...)``), checked against the model sources of
#: the given team (the source build's: a campaign is no way around them), submitted for the campaign's principal)
#: and returns the build id, or raises a refusal (SubmitRefused, ModelRefError, SpecError).
SubmitDocument = Callable[[dict[str, Any], PinnedModel | None, str | None], int]


def refusal_text(exc: Exception) -> str:
    if isinstance(exc, SpecError):
        return f"the spec is invalid for the new release: {exc}"
    if isinstance(exc, ModelRefError):
        return f"{exc.field}: {exc.message}"
    return str(exc)


def start(sessions: sessionmaker[Session], selection: Selection, submit: SubmitDocument,
          principal: Principal | None, *, policy_id: int | None = None, queue_anyway: bool = False) -> int:
    """Create a roll-forward campaign and submit every item (:func:`submit_items`); returns its id. Items are
    recorded before any submit, so the campaign lists everything it set out to move even if a submit fails, and
    a relay can submit those its starter did not reach (a process that died mid-loop). ``policy_id``: the
    standing policy starting it (:mod:`compilesvc.lifecycle.policies`), not an operator. ``principal`` and
    ``queue_anyway`` are what ``submit`` submits with, recorded so a relay resuming the campaign does the same
    (:mod:`compilesvc.lifecycle.resume`)."""
    with transaction(sessions) as session:
        found = candidates(session, selection)
        campaign = Campaign(kind=ROLLFORWARD, from_sdk=selection.from_sdk, to_sdk=selection.to_sdk,
                            selection=selection.to_json(), state=CampaignState.RUNNING,
                            created_by=principal.owner if principal else None,
                            team=principal.team if principal else None,
                            token_id=principal.token_id if principal else None, policy_id=policy_id,
                            queue_anyway=queue_anyway)
        session.add(campaign)
        session.flush()
        events.record(session, "campaign", campaign.id, None, CampaignState.RUNNING, from_sdk=selection.from_sdk,
                      to_sdk=selection.to_sdk, total=len(found), policy_id=policy_id)
        items = [CampaignItem(campaign_id=campaign.id, source_key=c.artifact_key, source_build_id=c.build_id)
                 for c in found]
        session.add_all(items)
        session.flush()
        campaign_id = campaign.id
    submit_items(sessions, campaign_id, submit)
    return campaign_id


def _claim_item(sessions: sessionmaker[Session], item_id: int) -> bool:
    """Claim an item's submit: a conditional update the ledger decides, so of two starters (a relay resuming
    a campaign, a slow starter) one submits it. A claim older than :data:`CLAIM_SECONDS` lost its claimer."""
    now = utcnow()
    with transaction(sessions) as session:
        claimed = session.execute(
            update(CampaignItem)
            .where(CampaignItem.id == item_id, CampaignItem.build_id.is_(None), CampaignItem.refusal.is_(None),
                   CampaignItem.submit_claimed_at.is_(None)
                   | (CampaignItem.submit_claimed_at < now - timedelta(seconds=CLAIM_SECONDS)))
            .values(submit_claimed_at=now).execution_options(synchronize_session=False))
        return bool(getattr(claimed, "rowcount", 0) == 1)


def resumable(grace_seconds: float, max_age_seconds: float) -> Select[int]:
    """Running campaigns created between ``grace_seconds`` and ``max_age_seconds`` ago with an item nobody
    submitted or is submitting (no build, no refusal, no live claim): their starter died mid-loop. Narrowed
    by whoever resumes them (a policy's: :func:`compilesvc.lifecycle.policies.half_submitted`; an
    operator's: :func:`compilesvc.lifecycle.resume.stalled`)."""
    now = utcnow()
    open_item = (select(CampaignItem.id)
                 .where(CampaignItem.campaign_id == Campaign.id, CampaignItem.build_id.is_(None),
                        CampaignItem.refusal.is_(None),
                        CampaignItem.submit_claimed_at.is_(None)
                        | (CampaignItem.submit_claimed_at < now - timedelta(seconds=CLAIM_SECONDS)))
                 .exists())
    return (select(Campaign.id)
            .where(Campaign.state == CampaignState.RUNNING,
                   Campaign.created_at < now - timedelta(seconds=grace_seconds),
                   Campaign.created_at >= now - timedelta(seconds=max_age_seconds), open_item)
            .order_by(Campaign.id))


def _release_item(sessions: sessionmaker[Session], item_id: int) -> None:
    with transaction(sessions) as session:
        session.get_one(CampaignItem, item_id).submit_claimed_at = None


def unsubmitted(session: Session, campaign_id: int) -> list[tuple[int, str, dict[str, Any], str | None]]:
    """The campaign's items with neither a build nor a refusal: (item id, source key, the source build's spec and
    team)."""
    rows = session.execute(
        select(CampaignItem.id, CampaignItem.source_key, Build.spec, Build.team)
        .join(Build, Build.id == CampaignItem.source_build_id)
        .where(CampaignItem.campaign_id == campaign_id, CampaignItem.build_id.is_(None),
               CampaignItem.refusal.is_(None)).order_by(CampaignItem.id)).all()
    return [(row.id, row.source_key, dict(row.spec), row.team) for row in rows]


def submit_items(sessions: sessionmaker[Session], campaign_id: int, submit: SubmitDocument) -> int:
    """Submit each item of the campaign nobody has submitted (or is submitting), each once whoever else runs
    this at the same time (:func:`_claim_item`), then settle the campaign; how many this call submitted.
    :func:`start` runs it, and the relay for a campaign whose starter died mid-loop
    (:func:`compilesvc.lifecycle.policies.start_stalled`, :func:`compilesvc.lifecycle.resume.resume_stalled`)."""
    with sessions() as session:
        to_sdk = session.get_one(Campaign, campaign_id).to_sdk
        planned = unsubmitted(session, campaign_id)
        # Each item rolls its artifact's own pin (the same bytes), resumed or not.
        models = _first_compile_model(session, sorted({source_key for _, source_key, _, _ in planned}))
    submitted = 0
    for item_id, source_key, spec, team in planned:
        if not _claim_item(sessions, item_id):
            continue  # another starter has it
        build_id, refusal = None, None
        try:
            build_id = submit(rolled_spec(spec, to_sdk, campaign_id), _pin_of(spec, models.get(source_key)), team)
        except ModelPinning:
            # Not a refusal: the model is being hashed in the background. The claim is let go, so the relay's
            # next pass (resume / policies.start_stalled) submits the item once its pin is known.
            _release_item(sessions, item_id)
            continue
        except (SubmitRefused, ModelRefError, SpecError) as exc:
            refusal = refusal_text(exc)
        except Exception as exc:  # the store or ledger failed mid-campaign: the item says so, the rest go on
            log.exception("campaign submit failed", extra={"campaign_id": campaign_id, "source_key": source_key})
            refusal = f"the submit failed ({type(exc).__name__}: {exc}); start the roll-forward again for it"
        with transaction(sessions) as session:
            item = session.get_one(CampaignItem, item_id)
            item.build_id, item.refusal = build_id, refusal
        submitted += 1
    with transaction(sessions) as session:
        settle(session, campaign_id)  # builds that ended before their item named them (hits: at once)
    return submitted


def on_build_transition(session: Session, transition: events.Transition) -> None:
    """In the transaction moving a build (its row still has the old state): finish or reopen the campaign
    it belongs to, if any."""
    build_id = transition.entity_id
    campaign_id = session.scalar(select(CampaignItem.campaign_id).where(CampaignItem.build_id == build_id))
    if campaign_id is not None:
        settle(session, campaign_id, moving=(build_id, transition.to_state))


#: Builds that move finish or reopen their campaign. A build just created is no campaign's item yet: its
#: item names it once the submit returns, and :func:`start` settles the campaign then.
BUILDS = events.Subscriber("campaigns", frozenset({"build"}), lambda t: t.from_state is not None,
                           on_build_transition)


def settle(session: Session, campaign_id: int, moving: tuple[int, str] | None = None) -> None:
    """Finish the campaign when nothing in it is still to end; reopen it when something is again.
    ``moving``: a build whose new state is not written yet, and that state."""
    campaign = session.scalars(select(Campaign).where(Campaign.id == campaign_id).with_for_update()).one()
    still_open = (select(func.count()).select_from(CampaignItem)
                  .outerjoin(Build, Build.id == CampaignItem.build_id)
                  .where(CampaignItem.campaign_id == campaign_id, CampaignItem.refusal.is_(None),
                         (CampaignItem.build_id.is_(None)) | Build.state.not_in(list(ENDED))))
    if moving is not None:
        still_open = still_open.where((CampaignItem.build_id.is_(None)) | (CampaignItem.build_id != moving[0]))
    open_items = (session.scalar(still_open) or 0) + (1 if moving is not None and moving[1] not in ENDED else 0)
    if open_items == 0 and campaign.state == CampaignState.RUNNING:
        events.record(session, "campaign", campaign.id, campaign.state, CampaignState.FINISHED)
        campaign.state, campaign.finished_at = CampaignState.FINISHED, utcnow()
    elif open_items and campaign.state == CampaignState.FINISHED:
        events.record(session, "campaign", campaign.id, campaign.state, CampaignState.RUNNING, reason="reopened")
        campaign.state, campaign.finished_at = CampaignState.RUNNING, None


@dataclass
class Progress:
    """Where a campaign stands: counts by what happened to each item, and the failures and refusals."""

    total: int = 0
    submitted: int = 0
    building: int = 0
    built: int = 0  # compiled (new, or joined a compile) and published
    hit: int = 0  # the new release's artifact existed already
    failed: int = 0
    cancelled: int = 0
    refused: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, Any]] = field(default_factory=list)
    items: list[dict[str, Any]] = field(default_factory=list)


def progress(session: Session, campaign: Campaign) -> Progress:
    out = Progress()
    rows = session.execute(
        select(CampaignItem.source_key, CampaignItem.refusal, CampaignItem.build_id, Build.state, Build.outcome,
               Build.artifact_key, Build.artifact_id)
        .outerjoin(Build, Build.id == CampaignItem.build_id)
        .where(CampaignItem.campaign_id == campaign.id).order_by(CampaignItem.id)
    ).all()
    failed_ids = [row.artifact_id for row in rows if row.state == BuildState.FAILED]
    errors = _first_failures(session, failed_ids)
    out.total = len(rows)
    for row in rows:
        item: dict[str, Any] = {"source_key": row.source_key, "build_id": row.build_id, "state": row.state,
                                "outcome": row.outcome, "artifact_key": row.artifact_key, "refusal": row.refusal}
        out.items.append(item)
        if row.refusal is not None:
            out.refused += 1
            out.refusals.append({"source_key": row.source_key, "refusal": row.refusal})
            continue
        if row.build_id is None:
            continue
        out.submitted += 1
        if row.state == BuildState.BUILDING:
            out.building += 1
        elif row.state == BuildState.SUCCEEDED:
            if row.outcome == Outcome.HIT:
                out.hit += 1
            else:
                out.built += 1
        elif row.state == BuildState.CANCELLED:
            out.cancelled += 1
        elif row.state == BuildState.FAILED:
            out.failed += 1
            out.failures.append({"source_key": row.source_key, "build_id": row.build_id,
                                 "artifact_key": row.artifact_key, **errors.get(row.artifact_id, {})})
    return out


def _first_failures(session: Session, artifact_ids: list[int]) -> dict[int, dict[str, Any]]:
    """For each failed artifact, its first failed bucket (by position) and the compiler's error."""
    if not artifact_ids:
        return {}
    rows = session.execute(
        select(ArtifactBucket.artifact_id, ArtifactBucket.position, BucketCompile.inputs, BucketCompile.error_class,
               BucketCompile.error_code, BucketCompile.error_message)
        .join(BucketCompile, and_(BucketCompile.id == ArtifactBucket.bucket_compile_id,
                                  BucketCompile.state == BucketState.FAILED))
        .where(ArtifactBucket.artifact_id.in_(artifact_ids)).order_by(ArtifactBucket.position)
    ).all()
    found: dict[int, dict[str, Any]] = {}
    for row in rows:
        found.setdefault(row.artifact_id, {"position": row.position, "inputs": row.inputs,
                                           "error_class": row.error_class, "error_code": row.error_code,
                                           "error_message": row.error_message})
    return found
