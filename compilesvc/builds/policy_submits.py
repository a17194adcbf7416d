"""How a standing roll-forward policy's campaign submits its spec documents
(:data:`compilesvc.lifecycle.campaigns.SubmitDocument`), whoever starts it: the first worker of the release
(workers/cli.py), the relay that starts or resumes what a dead starter left (compilesvc/cli/daemon.py), and the
API's enable request catching up (web/api/rollforward_policies.py). One function, so the three cannot drift."""

from __future__ import annotations

from typing import Any

from compilesvc.builds.submit import Submitter
from compilesvc.lifecycle.campaigns import SubmitDocument
from compilesvc.pinning.pins import PinnedModel
from compilesvc.spec.parsing import parse_spec


def policy_submit(submitter: Submitter) -> SubmitDocument:
    """Submit a rolled spec as a policy does: parsed with the service's own element bounds and extra flags (as
    the API parses a spec), for no principal, its compiles queued even when no worker of the new release is up
    yet (other targets' workers of it may not have registered), its model checked against the source build's
    team's model sources (:mod:`compilesvc.pinning.model_sources`)."""
    settings = submitter.settings

    def submit(document: dict[str, Any], model: PinnedModel | None, team: str | None) -> int:
        # ``model``: the rolled artifact's own pin (the same bytes), None to pin the document's URI again;
        # ``team``: the source build's, whose model sources the model must still be among.
        spec = parse_spec(document, settings.element_limits, settings.extra_flags)
        return submitter.submit(submitter.prepare(spec, model, team=team), queue_anyway=True).build_id

    return submit
