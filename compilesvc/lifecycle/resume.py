"""Operators' roll-forward campaigns whose starter died mid-loop, resumed by the relay.

An operator's campaign (``POST /v1/campaigns/rollforward``, ``compilesvc rollforward``) records its items,
then submits them one by one inside the API request (:func:`compilesvc.lifecycle.campaigns.start`). An API
worker killed meanwhile (OOM, a deploy, a lost node) leaves items with neither a build nor a refusal, and a
campaign that would run forever. The relay (compilesvc/cli/daemon.py) submits them (:func:`resume_stalled`)
once the campaign is :data:`~compilesvc.lifecycle.policies.START_GRACE_SECONDS` old (a live request is still
submitting it; its claims would keep the relay off its items anyway) and while it is younger than
:data:`~compilesvc.lifecycle.policies.MAX_START_AGE_SECONDS` (an older one predates the relay or outlived an
outage: start it again by hand). Each item is submitted once however many relays run and whether the request
was only slow (:func:`compilesvc.lifecycle.campaigns.submit_items`' claims), as the request would have: for
the campaign's recorded owner and token (admission counts it; each build is its source build's team's),
with its recorded ``queue_anyway``, the spec parsed as the API parses one (one submit function for every
starter: :func:`compilesvc.builds.policy_submits.campaign_submit`).

Only a running campaign is resumed: a finished one has nothing left, and no other state keeps items open. A
standing policy's campaign is its policy's to resume (:func:`compilesvc.lifecycle.policies.start_stalled`,
not while the policy is disabled); one whose policy was removed is an orphan the relay resumes here, as the
policy would have (no principal, queued anyway: recorded when it started).

A token revoked or expired since the campaign started: the items left are *refused* (the campaign then
settles and says why), not submitted. The relay acts on the token's authority, and revoking a token is the
one way an operator says "nothing more in this name" -- a leaked admin token's roll-forward must stop when
the token is revoked, and an expiry is the same decision made in advance. Starting the roll-forward again
with a live token moves what is left (what was built already is a hit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from compilesvc.access import tokens
from compilesvc.access.tokens import Principal
from compilesvc.ledger.campaigns import Campaign
from compilesvc.ledger.models import ApiToken, utcnow
from compilesvc.lifecycle import campaigns, policies
from compilesvc.pinning.pins import PinnedModel
from compilesvc.refusals import SubmitRefused

log = logging.getLogger(__name__)

#: Makes the submit function for a campaign's principal and ``queue_anyway``.
SubmitAs = Callable[[Principal | None, bool], campaigns.SubmitDocument]


def stalled(session: Session, grace_seconds: float = policies.START_GRACE_SECONDS,
            max_age_seconds: float = policies.MAX_START_AGE_SECONDS) -> list[int]:
    """Running campaigns of no policy (an operator's, or a removed policy's) with items their starter did not
    reach, created between ``grace_seconds`` and ``max_age_seconds`` ago."""
    return list(session.scalars(campaigns.resumable(grace_seconds, max_age_seconds)
                                .where(Campaign.policy_id.is_(None))))


def principal_of(session: Session, campaign: Campaign) -> tuple[Principal | None, str | None]:
    """Who the campaign submits as: its recorded token, owner and team (None: it recorded no token); or why
    it may not submit any more (the token revoked, expired or gone)."""
    if campaign.token_id is None:
        return None, None
    row = session.get(ApiToken, campaign.token_id)
    if row is None or not tokens.is_active(row, utcnow()):
        why = "was deleted" if row is None else "was revoked" if row.revoked_at is not None else "expired"
        name = f"{row.name!r} " if row is not None else ""
        return None, (f"not submitted: the token {name}(id {campaign.token_id}) that started the campaign {why} "
                      f"before its remaining items were submitted; start the roll-forward again with a live token")
    # The recorded owner and team, not the token's as it is now (each build itself is its source build's team's).
    return replace(tokens.principal_of(row), owner=campaign.created_by or row.owner,
                   team=campaign.team or row.team), None


def _refusing(text: str) -> campaigns.SubmitDocument:
    def submit(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
        raise SubmitRefused(text)

    return submit


def resume(sessions: sessionmaker[Session], campaign_id: int, submit_as: SubmitAs) -> int:
    """Submit (or refuse, for a token no longer live) the campaign's items nobody submitted or is submitting,
    each once; how many this call took."""
    with sessions() as session:
        campaign = session.get_one(Campaign, campaign_id)
        principal, refusal = principal_of(session, campaign)
        queue_anyway = campaign.queue_anyway
    submit = _refusing(refusal) if refusal is not None else submit_as(principal, queue_anyway)
    return campaigns.submit_items(sessions, campaign_id, submit)


def resume_stalled(sessions: sessionmaker[Session], submit_as: SubmitAs,
                   grace_seconds: float = policies.START_GRACE_SECONDS,
                   max_age_seconds: float = policies.MAX_START_AGE_SECONDS) -> list[int]:
    """The relay's pass: resume every stalled operator campaign; the ids of those it submitted items of."""
    with sessions() as session:
        found = stalled(session, grace_seconds, max_age_seconds)
    resumed = []
    for campaign_id in found:
        log.warning("a campaign has items its starter did not submit: submitting them",
                    extra={"campaign_id": campaign_id})
        if resume(sessions, campaign_id, submit_as):
            resumed.append(campaign_id)
    return resumed
