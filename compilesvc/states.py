"""The ledger's state machines: which states exist, which moves between them are allowed, and who makes each.

This module is the one place that names a state. It is plain constants (the standard library only), so a
client reading a build's states loads no database code. The schema's CHECK constraints are generated from
these enums by the ledger (:func:`compilesvc.ledger.models.check_constraint`), and
:func:`compilesvc.ledger.events.record`, which every transition writes in its transaction, refuses a move this
table does not list, so a new transition cannot slip in unseen.

Bucket compile (one row per bucket key; the unit a worker compiles)::

    (new) ──submit──▶ queued ──claim──▶ running ──succeed──▶ succeeded
                        ▲  ▲               │
                        │  └──requeue──────┤  infra / timeout failure with attempts left (after a backoff),
                        │                  │  lease expired (reaper), cancel superseded by a new request
                        │                  ├──fail──▶ failed     compile error or rejected flag (final: the
                        │                  │                     negative cache), model gone, attempts or
                        │                  │                     unknown-failure retries exhausted, or the
                        │                  │                     same infra failure twice in a row
                        │                  └──cancel─▶ cancelled
                        └──resubmit / retry── failed | cancelled      (a compile error only by explicit retry)
    queued ──cancel──▶ cancelled;   (new) ──import──▶ succeeded (a manifest found in the store)
    succeeded ──retention──▶ deleted ──a submit that needs it──▶ queued

A queued compile is never stuck on a lost message: the reconciler (:mod:`compilesvc.compiles.reconcile`) re-sends
one whose message is neither queued nor held by a worker, and the reaper (:mod:`compilesvc.compiles.reaper`) takes
back a running one whose lease ran out.

Artifact (one row per artifact key; a set of bucket compiles)::

    (new) ──submit──▶ building ──every bucket succeeded──▶ published (final)
                      building ──a bucket failed for good──▶ failed ──resubmit / retry──▶ building
                      building ──its last build cancelled──▶ cancelled ──resubmit / retry──▶ building
                      cancelled ──resubmitted, a bucket failed with a compile error meanwhile──▶ failed
    (new) ──import──▶ published
    published ──retention──▶ deleted ──resubmit──▶ building

Build (one row per submission) follows its artifact (:data:`BUILD_STATE_FOR_ARTIFACT`) unless cancelled
itself; a retry moves a failed or cancelled build back to building.
"""

from __future__ import annotations

from enum import StrEnum


class BucketState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DELETED = "deleted"  # retention removed its files; a submit that needs it compiles it again


class ArtifactState(StrEnum):
    BUILDING = "building"
    PUBLISHED = "published"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DELETED = "deleted"  # retention removed it; a resubmit builds it again


class BuildState(StrEnum):
    BUILDING = "building"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CampaignState(StrEnum):
    """A roll-forward campaign: running until every item's build has ended (or its submit was refused);
    a retried build reopens it."""

    RUNNING = "running"
    FINISHED = "finished"


class ServiceEvent(StrEnum):
    """Events a subscription may ask for (a build's own callbacks get ``build.<its terminal state>``)."""

    ARTIFACT_PUBLISHED = "artifact.published"
    BUILD_FAILED = "build.failed"
    CAMPAIGN_FINISHED = "campaign.finished"
    CAMPAIGN_STARTED = "campaign.started"


class PinKind(StrEnum):
    """What a retention pin keeps: one artifact, every artifact of a model name, or of a build label."""

    ARTIFACT = "artifact"
    MODEL = "model"
    LABEL = "label"


class Outcome(StrEnum):
    """How a submission was answered: a published artifact, one in flight, or a new one."""

    HIT = "hit"
    JOIN = "join"
    NEW = "new"


class ErrorClass(StrEnum):
    """Why an attempt failed, which decides what happens next (:data:`RETRIED`, :data:`REQUEUED_BY_SUBMIT`)."""

    COMPILE = "compile"  # the compiler refused the model: final for the key until an explicit retry
    BAD_REQUEST = "bad_request"  # the compiler rejected a flag of the spec: final, like a compile error
    MODEL = "model"  # the pinned model bytes are gone or changed: a new submit re-pins them
    INFRA = "infra"  # the host, the store, the broker or the ledger failed: retried
    TIMEOUT = "timeout"  # the compile ran out of time: retried like infra
    UNKNOWN = "unknown"  # the compiler failed with nothing saying why: retried a bounded number of times
    CANCELLED = "cancelled"


#: Failures a worker's attempt is retried after (with a backoff), while attempts remain; an unknown failure
#: only ``unknown_failure_retries`` times (:func:`compilesvc.compiles.leases.fail`).
RETRIED: frozenset[ErrorClass] = frozenset({ErrorClass.INFRA, ErrorClass.TIMEOUT, ErrorClass.UNKNOWN})
#: Failures that are the key's answer until an explicit retry (the negative cache): the compiler's verdict on
#: the model, or on a flag of the spec. Both are deterministic for the key (the flags and the SDK release
#: are key material), so compiling again could only say the same.
NEGATIVELY_CACHED: frozenset[ErrorClass] = frozenset({ErrorClass.COMPILE, ErrorClass.BAD_REQUEST})


def failed_for_good(state: str, error_class: str | None) -> bool:
    """A bucket compile whose failure is its key's answer until an explicit retry (:data:`NEGATIVELY_CACHED`)."""
    return state == BucketState.FAILED and error_class in NEGATIVELY_CACHED


#: Failures a new submit requeues: everything not negatively cached (a model failure is requeued with the
#: new submit's pin of the same bytes; an unknown one gets a fresh bounded set of retries).
REQUEUED_BY_SUBMIT: frozenset[ErrorClass] = frozenset(
    {ErrorClass.MODEL, ErrorClass.INFRA, ErrorClass.TIMEOUT, ErrorClass.UNKNOWN, ErrorClass.CANCELLED})

BUILD_STATE_FOR_ARTIFACT: dict[str, BuildState] = {
    ArtifactState.BUILDING: BuildState.BUILDING,
    ArtifactState.PUBLISHED: BuildState.SUCCEEDED,
    ArtifactState.FAILED: BuildState.FAILED,
    ArtifactState.CANCELLED: BuildState.CANCELLED,
    ArtifactState.DELETED: BuildState.SUCCEEDED,  # its builds did succeed; history keeps saying so
}

B, A, D = BucketState, ArtifactState, BuildState

#: Every allowed move, by entity, as ``(from, to)``; ``None`` is "did not exist".
TRANSITIONS: dict[str, frozenset[tuple[str | None, str]]] = {
    "bucket": frozenset({
        (None, B.QUEUED), (None, B.SUCCEEDED),
        (B.QUEUED, B.RUNNING), (B.QUEUED, B.CANCELLED),
        (B.RUNNING, B.SUCCEEDED), (B.RUNNING, B.FAILED), (B.RUNNING, B.CANCELLED), (B.RUNNING, B.QUEUED),
        (B.FAILED, B.QUEUED), (B.CANCELLED, B.QUEUED),
        (B.SUCCEEDED, B.DELETED), (B.DELETED, B.QUEUED),  # retention; a submit that needs it again
    }),
    "artifact": frozenset({
        (None, A.BUILDING), (None, A.PUBLISHED),
        (A.BUILDING, A.PUBLISHED), (A.BUILDING, A.FAILED), (A.BUILDING, A.CANCELLED),
        (A.FAILED, A.BUILDING), (A.CANCELLED, A.BUILDING),
        (A.CANCELLED, A.FAILED),  # resubmitted while a bucket it shares failed with a compile error
        (A.PUBLISHED, A.DELETED), (A.DELETED, A.BUILDING),  # retention; a resubmit builds it again
    }),
    "build": frozenset({
        (None, D.BUILDING), (None, D.SUCCEEDED), (None, D.FAILED),
        (D.BUILDING, D.SUCCEEDED), (D.BUILDING, D.FAILED), (D.BUILDING, D.CANCELLED),
        (D.FAILED, D.BUILDING), (D.CANCELLED, D.BUILDING),
    }),
    "campaign": frozenset({
        (None, CampaignState.RUNNING), (None, CampaignState.FINISHED),
        (CampaignState.RUNNING, CampaignState.FINISHED), (CampaignState.FINISHED, CampaignState.RUNNING),
    }),
}

del B, A, D


class IllegalTransition(RuntimeError):
    """A move the state machine does not allow: a bug in the caller, never a user error."""


def check_transition(entity: str, from_state: str | None, to_state: str) -> None:
    """Raise :class:`IllegalTransition` unless ``entity`` may move from ``from_state`` to ``to_state``."""
    allowed = TRANSITIONS.get(entity)
    if allowed is None or (from_state, to_state) not in allowed:
        raise IllegalTransition(f"{entity}: {from_state!r} -> {to_state!r} is not a transition of its state machine")

