"""The Celery task: a thin shell around :func:`workers.compiling.runner.run_compile`.

The task's arguments beyond ``bucket_compile_id`` exist for routing (:func:`compilesvc.dispatch.routing.route_task`)
and for reading a queue by eye; the compile itself is described by the ledger row, which the runner claims.

The worker builds one :class:`~compilesvc.services.Services` on first use, shared by its pool threads
(engines and sessionmakers are thread-safe; ``compilesvc worker`` runs the threads pool only).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Reject
from celery.signals import worker_ready

from compilesvc.dispatch.routing import COMPILE_TASK
from compilesvc.services import Services
from workers.celery_app import worker_app
from workers.compiling.drain import DRAIN
from workers.compiling.runner import ClaimNotRecorded, run_compile
from workers.host.pod_protection import PodProtection
from workers.liveness import CANARY_TASK, LIVENESS

log = logging.getLogger(__name__)

#: The registered worker id (set by ``compilesvc worker`` before the pool starts).
_worker_id: str | None = None
#: ``compilesvc worker --max-compiles``: stop after this many compiles ended (None: never).
_max_compiles: int | None = None
_ended = 0
#: ``COMPILESVC_KUBERNETES_PROTECT``: the pod's annotations follow the running compiles.
_protection: PodProtection | None = None
_services: tuple[int, Services] | None = None
_services_lock = threading.Lock()
_ended_lock = threading.Lock()


def configure(worker_id: str, max_compiles: int | None = None, protection: PodProtection | None = None) -> None:
    global _worker_id, _max_compiles, _protection
    _worker_id = worker_id
    _max_compiles = max_compiles
    _protection = protection


def _count_ended() -> None:
    """One compile more has ended here; at ``--max-compiles``, stop as if told to (a Kubernetes Job's pod
    runs one compile and exits: the chart's ScaledJob mode)."""
    global _ended
    with _ended_lock:
        _ended += 1
        done = _max_compiles is not None and _ended == _max_compiles
    if done:
        log.info("max compiles reached: stopping", extra={"compiles": _ended})
        os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown, and the drain of whatever still runs


def worker_id() -> str:
    return _worker_id or f"compilesvc-{os.getpid()}@{socket.gethostname()}"


def services() -> Services:
    """This process's services, sending requeues through the worker's own app."""
    global _services
    with _services_lock:
        if _services is None or _services[0] != os.getpid():
            _services = (os.getpid(), Services.from_settings(pre_ping=True, celery_app=worker_app()))
        return _services[1]


@shared_task(name=COMPILE_TASK, bind=True, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
def compile_bucket(self: Task[Any, Any], bucket_compile_id: int, target: str, sdk: str, backend: str,
                   isa: str | None = None, queue: str | None = None) -> str:
    if DRAIN.draining:  # told to stop: a compile started now would only be handed back (workers.compiling.drain)
        raise Reject("the worker is draining", requeue=True)
    if LIVENESS.stopping.is_set():  # stopping to be restarted (workers.liveness): a fresh worker takes it
        raise Reject(f"the worker is stopping: {LIVENESS.why}", requeue=True)
    if _protection is not None:
        _protection.started()
    try:
        result = run_compile(services(), bucket_compile_id, worker_id())
    except ClaimNotRecorded as exc:
        # Acknowledging would drop the only message of a compile that is still queued in the ledger; give it
        # back to the broker (after run_compile's own retries, so this is no hot loop). Should the message
        # be lost anyway, the reconciler re-sends it.
        log.warning("claim failed; message returned to the queue",
                    extra={"bucket_compile_id": bucket_compile_id, "error": str(exc)})
        raise Reject(str(exc), requeue=True) from exc
    finally:
        if _protection is not None:
            _protection.ended()
    # The one line that says this worker is done with the message, whatever became of the attempt.
    log.info("task done", extra={"bucket_compile_id": bucket_compile_id, "attempt": result.attempt,
                                 "result": result.status})
    if result.status != "nothing-to-claim":
        _count_ended()
    return result.status


@shared_task(name=CANARY_TASK, acks_late=False, ignore_result=True)  # type: ignore[untyped-decorator]
def canary() -> None:
    """Nothing: its arrival is the proof (the consumer's ``task_received``, :mod:`workers.liveness`)."""


@worker_ready.connect  # type: ignore[untyped-decorator]
def _announce_ready(**_: Any) -> None:
    # Tests and operators wait for this line: from here on the worker consumes its queues.
    log.info("worker ready", extra={"worker": worker_id()})
