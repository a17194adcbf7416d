"""State-transition events: one row per change of state of a build, artifact, bucket compile or campaign,
each checked against its state machine (:mod:`compilesvc.states`), and the subscribers told of it in the
same transaction.

:func:`record` is the one path: it checks the move, writes its ``events`` row, then calls each subscriber
that wants it, in the order they were installed. Subscribers (webhooks' deliveries, campaigns finishing)
are installed by the composition root, :func:`compilesvc.services.install_subscribers`, never imported
here: this module is below everything that reacts to a change. A process that writes an event before
installing them raises :class:`SubscribersNotInstalled` instead of silently dropping a webhook.

Builds are born in batches (group commit, :mod:`compilesvc.ledger.build_records`), on Postgres by one statement
that writes their events itself; such a writer checks with :func:`check`, writes, then calls
:func:`notify`, and asks :func:`wanted` first to know whether a subscriber will write anything (a hit's
build wants nothing, so its batch stays one statement in autocommit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Connection, Table, insert
from sqlalchemy.orm import Session

from compilesvc.ledger.models import Event
from compilesvc.states import check_transition

# Built once, with the rows passed as parameters: one of these runs in every submit, and a statement with
# literal values is compiled and cache-keyed value by value on every call.
_INSERT_EVENT = insert(cast(Table, Event.__table__))


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of state, as subscribers see it."""

    entity: str
    entity_id: int
    from_state: str | None
    to_state: str
    #: What the ``events`` row says about it (stored).
    detail: Mapping[str, Any] = field(default_factory=dict)
    #: A build's callback URLs, given when it is created (not stored with the event: the webhooks subscriber
    #: records them, and notifies them at once when the build is born ended).
    callbacks: tuple[str, ...] = ()

    def row(self) -> dict[str, Any]:
        return {"entity": self.entity, "entity_id": self.entity_id,
                "from_state": None if self.from_state is None else str(self.from_state),
                "to_state": str(self.to_state), "detail": dict(self.detail)}


@dataclass(frozen=True)
class Subscriber:
    """Something that reacts to a transition in its transaction: ``handle`` is called for each transition of
    one of ``entities`` that ``wants`` (a check of the transition alone, no query) says it acts on."""

    name: str
    entities: frozenset[str]
    wants: Callable[[Transition], bool]
    handle: Callable[[Session, Transition], None]


class SubscribersNotInstalled(RuntimeError):
    """An event written by a process that never installed the subscribers: its webhooks and campaigns would
    miss the change."""

    def __init__(self) -> None:
        super().__init__("a state change was recorded before the event subscribers were installed: call "
                         "compilesvc.services.install_subscribers() at the process's start (Services does it)")


#: The installed subscribers, in order, and those of each entity (in the same order); None until :func:`install`.
_installed: tuple[Subscriber, ...] | None = None
_by_entity: dict[str, tuple[Subscriber, ...]] = {}


def install(subscribers: Sequence[Subscriber]) -> None:
    """Make ``subscribers`` (in this order) the ones every transition is offered to, replacing any before."""
    global _installed, _by_entity
    entities = {entity for subscriber in subscribers for entity in subscriber.entities}
    _by_entity = {entity: tuple(s for s in subscribers if entity in s.entities) for entity in entities}
    _installed = tuple(subscribers)


def installed() -> tuple[Subscriber, ...]:
    """The installed subscribers, in order."""
    return _installed or ()


def _subscribers(entity: str) -> tuple[Subscriber, ...]:
    if _installed is None:
        raise SubscribersNotInstalled
    return _by_entity.get(entity, ())


def check(transitions: Iterable[Transition]) -> None:
    """Raise :class:`~compilesvc.states.IllegalTransition` for a move the state machine does not have, and
    :class:`SubscribersNotInstalled` before anything is written in a process that would drop its webhooks."""
    for transition in transitions:
        check_transition(transition.entity, transition.from_state, transition.to_state)
        _subscribers(transition.entity)


def wanted(transitions: Iterable[Transition]) -> bool:
    """Whether any installed subscriber acts on one of ``transitions`` (it will write in the transaction)."""
    return any(s.wants(t) for t in transitions for s in _subscribers(t.entity))


def notify(bind: Session | Connection, transitions: Iterable[Transition]) -> None:
    """Call the subscribers of ``transitions``, already written, in ``bind``'s transaction."""
    session = bind if isinstance(bind, Session) else None
    for transition in transitions:
        for subscriber in _subscribers(transition.entity):
            if subscriber.wants(transition):
                if session is None:  # a group commit's connection: a session joins its transaction
                    session = Session(bind=cast(Connection, bind))
                subscriber.handle(session, transition)
    if session is not None and session is not bind:
        session.close()


def record(session: Session, entity: str, entity_id: int, from_state: str | None, to_state: str,
           **detail: Any) -> None:
    """Write a transition event in the current transaction and tell its subscribers; raises
    :class:`~compilesvc.states.IllegalTransition` for a move the state machine does not have."""
    record_all(session, [Transition(entity, entity_id, from_state, to_state, detail)])


def record_all(bind: Session | Connection, transitions: Sequence[Transition]) -> None:
    """Write the events of ``transitions`` (one INSERT) and tell their subscribers, in ``bind``'s transaction."""
    if not transitions:
        return
    check(transitions)
    bind.execute(_INSERT_EVENT, [t.row() for t in transitions] if len(transitions) > 1 else transitions[0].row())
    notify(bind, transitions)
