"""How hard the fault suite hits: ``COMPILESVC_FAULT_SCALE=ci`` (the default) or ``heavy`` (the bench's).

Each fault test proves a recovery property (no build lost, no attempt burnt, the compiler run once). What
the property depends on is the mechanism meeting the fault, not the fault's size: a publish that keeps
retrying through a 12 s outage, past its backoff cap, keeps retrying through a 60 s one (more capped
retries of the same kind); a reconciler that re-sends 4 lost messages re-sends 12. So CI runs the smallest
variant that still exercises every step of the mechanism (justified in tests/faults/README.md), and
``python -m bench.fault_recovery`` runs the issue's sizes (a 60 s outage, 12 lost builds) and records how
long recovery took (:mod:`tests.faults.recovery`).

``COMPILESVC_FAULT_OUTAGE_SECONDS`` still overrides both S3 outages' length, at either scale.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

SCALE_ENV = "COMPILESVC_FAULT_SCALE"
OUTAGE_ENV = "COMPILESVC_FAULT_OUTAGE_SECONDS"


@dataclass(frozen=True)
class Scale:
    name: str
    #: S3 down while a compile publishes (test_s3_outage_during_publish).
    outage_seconds: float
    #: S3 down while a worker fetches the model (test_s3_outage_while_the_model_is_fetched).
    fetch_outage_seconds: float
    #: Builds queued behind two busy workers when the broker loses its queue (test_broker_loss).
    queued_builds: int
    #: How long the two busy compiles run: long enough to submit ``queued_builds`` and break Redis first.
    busy_seconds: int

    def describe(self) -> str:
        return (f"scale {self.name}: S3 outage {self.outage_seconds:g} s (publish) / {self.fetch_outage_seconds:g} s "
                f"(fetch), {self.queued_builds} builds lost with the broker")


SCALES = {
    # Each outage outlasts the lease (3 s: a lease not renewed through the retries would be reaped, and the
    # attempt count would show it), the worker stale time (10 s) and twice the backoff cap (5 s: the retries
    # reach their cap and go on past it). 4 lost builds are twice the 2 compile slots, so re-sent messages
    # also wait in the queue, as the incident's 12 did.
    "ci": Scale("ci", outage_seconds=12, fetch_outage_seconds=12, queued_builds=4, busy_seconds=8),
    # The incident's sizes (issue 6): a 60 s S3 outage, 12 builds queued when Redis lost them.
    "heavy": Scale("heavy", outage_seconds=60, fetch_outage_seconds=60, queued_builds=12, busy_seconds=10),
}


def current() -> Scale:
    """The scale this run uses (environment), with an explicit outage length applied to both outages."""
    name = os.environ.get(SCALE_ENV, "ci").strip().lower() or "ci"
    if name not in SCALES:
        raise ValueError(f"{SCALE_ENV}={name!r}: expected one of {', '.join(SCALES)}")
    scale = SCALES[name]
    outage = os.environ.get(OUTAGE_ENV)
    if outage:
        scale = replace(scale, outage_seconds=float(outage), fetch_outage_seconds=float(outage))
    return scale


#: This run's scale.
SCALE = current()
