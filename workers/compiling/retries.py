"""Riding out infrastructure while an attempt holds its lease: the ledger (a restart, a failover) and the
store (an outage while the model is fetched or the outputs are published).

Both retry with the one backoff rule (:mod:`compilesvc.compiles.backoff`), each within a time budget, and each
failed try of the store is added to the compile's failure history, so the build shows the outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

from compilesvc.compiles import backoff, failures, leases
from compilesvc.compiles.logs import append_lines
from compilesvc.ledger.engine import transaction
from compilesvc.services import Services
from compilesvc.states import ErrorClass
from compilesvc.store import StoreUnavailable
from workers.isolation.compiler_process import StopSignal

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_transient(exc: DBAPIError) -> bool:
    """Connection loss, a deadlock, a server going away: a fresh transaction may well succeed."""
    return isinstance(exc, OperationalError) or exc.connection_invalidated


def with_db_retry(fn: Callable[[], T], budget_seconds: float) -> T:
    """Run a ledger transaction, retrying on connection loss and deadlocks for up to ``budget_seconds``
    with a jittered backoff (each try is a fresh transaction on a fresh connection: SQLAlchemy drops a
    pool whose connection died with the server; the fenced writes make a retry after an unknown commit
    outcome harmless). Long enough to ride out a database restart or failover."""
    deadline = time.monotonic() + budget_seconds
    retry = 0
    while True:
        try:
            return fn()
        except (OperationalError, DBAPIError) as exc:
            retryable = is_transient(exc)
            retry += 1
            pause = backoff.delay(retry, 0.5, 5.0)
            if not retryable or time.monotonic() + pause > deadline:
                raise
            log.warning("ledger write failed; retrying", extra={"error": str(exc).splitlines()[0],
                                                               "try": retry, "retry_in": round(pause, 2)})
            time.sleep(pause)


class ClaimNotRecorded(Exception):
    """The ledger could not be reached to claim a compile: its message must not be acknowledged."""


class StoreRetriesExhausted(Exception):
    """The store stayed unreachable for the whole retry budget; the message is the last error."""


class Interrupted(Exception):
    """The lease was lost or a cancel requested while waiting to retry."""


def retry_store(services: Services, claim: leases.Claim, stop: StopSignal, phase: str,
                action: Callable[[], T], logger: logging.LoggerAdapter[Any]) -> T:
    """Run ``action``, retrying while the store is unreachable (:class:`StoreUnavailable`) with a backoff for
    up to ``store_retry_seconds``, the lease kept, so that a store outage costs neither an attempt nor (at
    publish) the compiled output. Raises :class:`StoreRetriesExhausted` when the budget is spent and
    :class:`Interrupted` when ``stop`` is set during a wait. Any other error (a missing blob, a full disk)
    propagates at once: waiting would not change it."""
    deadline = time.monotonic() + services.settings.store_retry_seconds
    retry = 0
    while True:
        try:
            return action()
        except StoreUnavailable as exc:
            error = f"{type(exc).__name__}: {exc}"
            retry += 1
            pause = backoff.for_settings(services.settings, retry)
            if time.monotonic() + pause > deadline:
                raise StoreRetriesExhausted(error) from exc
        _note_store_retry(services, claim, phase, error, retry, pause, logger)
        if stop.wait(pause):
            raise Interrupted()


def _note_store_retry(services: Services, claim: leases.Claim, phase: str, error: str, retry: int, pause: float,
                      logger: logging.LoggerAdapter[Any]) -> None:
    code = STORE_CODES[phase]
    line = f"{phase} failed ({error}); retry {retry} in {pause:.1f}s, in this attempt"
    logger.warning("store unavailable; retrying", extra={"phase": phase, "error": error, "retry": retry,
                                                        "retry_in": round(pause, 1)})
    try:
        with transaction(services.sessions) as session:
            failures.record(session, claim.bucket_id, claim.attempt, phase, ErrorClass.INFRA, code, error,
                            retry=True)
            append_lines(session, claim.bucket_id, claim.attempt, [line], stream="service")
    except Exception as exc:  # the ledger is down too: the retry matters more than its record
        logger.warning("could not record the store failure", extra={"error": str(exc)})


#: The code a store failure is recorded under, by phase.
STORE_CODES = {failures.Phase.FETCH: "MODEL_FETCH_FAILED", failures.Phase.PUBLISH: "PUBLISH_FAILED"}
