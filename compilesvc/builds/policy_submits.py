"""How a roll-forward campaign submits its spec documents (:data:`compilesvc.lifecycle.campaigns.SubmitDocument`),
whoever starts or resumes it: an operator's API request (web/api/campaigns.py), and for a standing policy's the
first worker of the release (workers/cli.py) or the API's enable request catching up
(web/api/rollforward_policies.py); the relay resuming either kind whose starter died (compilesvc/cli/daemon.py).
One function, so they cannot drift."""

from __future__ import annotations

from typing import Any

from compilesvc.access.tokens import Principal
from compilesvc.builds.submit import Submitter
from compilesvc.lifecycle.campaigns import SubmitDocument
from compilesvc.pinning.pins import PinnedModel
from compilesvc.spec.parsing import parse_spec


def campaign_submit(submitter: Submitter, principal: Principal | None, *, queue_anyway: bool) -> SubmitDocument:
    """Submit a rolled spec parsed with the service's own element bounds and extra flags (as the API parses a
    spec), for ``principal`` (the build's submitter and team, the token admission counts; None for a policy's
    or an unauthenticated service's campaign), its compiles queued even while no worker serves the new release
    when ``queue_anyway``; its model checked against the source build's team's model sources
    (:mod:`compilesvc.pinning.model_sources`)."""
    settings = submitter.settings

    def submit(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
        # ``model``: the rolled artifact's own pin (the same bytes), None to pin the document's URI again;
        # ``team``: the source build's, whose model sources the model must still be among.
        spec = parse_spec(document, settings.element_limits, settings.extra_flags)
        return submitter.submit(submitter.prepare(spec, model, team=team), principal=principal,
                                queue_anyway=queue_anyway).build_id

    return submit


def policy_submit(submitter: Submitter) -> SubmitDocument:
    """Submit as a policy does: for no principal, its compiles queued even when no worker of the new release is
    up yet (other targets' workers of it may not have registered)."""
    return campaign_submit(submitter, None, queue_anyway=True)
