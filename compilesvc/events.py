"""State-transition events: one row per change of state of a build, artifact or bucket compile, each
checked against its state machine (:mod:`compilesvc.states`). A build's move to a terminal state also
writes its webhook deliveries (:mod:`compilesvc.webhooks`), and a build of a campaign may finish or reopen
it (:mod:`compilesvc.campaigns`). A published artifact, a failed build and a finished campaign notify the
URLs subscribed to that event."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, insert
from sqlalchemy.orm import Session

from compilesvc.ledger.models import Event
from compilesvc.states import ArtifactState, BuildState, CampaignState, ServiceEvent, check_transition
from compilesvc.webhooks import enqueue_event, enqueue_terminal

# Built once, with the row passed as parameters: one of these runs in every submit, and a statement with
# literal values is compiled and cache-keyed value by value on every call.
_INSERT_EVENT = insert(cast(Table, Event.__table__))


def record(session: Session, entity: str, entity_id: int, from_state: str | None, to_state: str,
           **detail: Any) -> None:
    """Write a transition event in the current transaction; raises
    :class:`~compilesvc.states.IllegalTransition` for a move the state machine does not have."""
    check_transition(entity, from_state, to_state)
    session.execute(_INSERT_EVENT, {"entity": entity, "entity_id": entity_id,
                                    "from_state": None if from_state is None else str(from_state),
                                    "to_state": str(to_state), "detail": detail})
    if entity == "build":  # a build that ends notifies its webhooks, in the transaction that ends it
        # Imported here: campaigns reaches artifacts (through retention), which records events with this
        # module, so importing artifacts first would find this one half-initialised.
        from compilesvc import campaigns

        enqueue_terminal(session, entity_id, str(to_state))
        campaigns.on_build_transition(session, entity_id, str(to_state))
    event = _SERVICE_EVENTS.get((entity, str(to_state)))
    if event is not None:  # and the service-wide subscribers of what just happened
        enqueue_event(session, event, entity_id)


_SERVICE_EVENTS: dict[tuple[str, str], ServiceEvent] = {
    ("artifact", ArtifactState.PUBLISHED): ServiceEvent.ARTIFACT_PUBLISHED,
    ("build", BuildState.FAILED): ServiceEvent.BUILD_FAILED,
    ("campaign", CampaignState.FINISHED): ServiceEvent.CAMPAIGN_FINISHED,
}
