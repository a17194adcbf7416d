"""State-transition events: one row per change of state of a build, artifact or bucket compile."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from compilesvc.ledger.models import Event


def record(session: Session, entity: str, entity_id: int, from_state: str | None, to_state: str,
           **detail: Any) -> None:
    """Add a transition event to the current transaction."""
    session.add(Event(entity=entity, entity_id=entity_id, from_state=from_state, to_state=to_state,
                      detail=detail))
