"""One attempt of one bucket compile on a worker: claim, fetch, compile in a child process, publish or fail.

:func:`run_compile` is everything the Celery task does. Its steps, and why they are in this order:

1. **Claim** (:func:`compilesvc.compiles.leases.claim`): one conditional UPDATE, retried through a ledger restart
   (:mod:`workers.compiling.retries`). Nothing to claim means a duplicate delivery, a cancelled or finished compile:
   log it and return (the message is acked, nothing runs). A claim that never reached the ledger raises
   :class:`ClaimNotRecorded`, and the task gives its message back.
2. **Lease heartbeat** (:class:`workers.compiling.lease_keeper.LeaseKeeper`): a thread renews the lease every
   ``heartbeat_seconds``. When the lease is lost (the reaper gave the compile to someone else) or a cancel
   is requested, it asks the main loop to kill the compiler's process group (SIGTERM, SIGKILL after a grace).
3. **Fetch** the pinned model (:meth:`ModelResolver.fetch`, digest-checked). A model that is gone or
   changed is a final error (``MODEL_UNAVAILABLE``); an unreachable store is waited for within the
   attempt (:func:`workers.compiling.retries.retry_store`); other store trouble is infra (a new attempt, backed off).
4. **Compile** in ``python -m workers.backends.compile_child`` (:mod:`workers.isolation.compiler_process`) inside
   the compile
   sandbox (:mod:`workers.isolation.sandbox`: another user, no network, a filesystem holding only the toolchain, the
   model and request read-only and its own directories writable, limits): a fresh temporary work dir as cwd,
   a new session/process group so the whole compiler tree can be killed, a hard timeout, an environment
   built from an allow-list (:mod:`workers.isolation.child_env`; plus, for Neuron targets,
   ``NEURON_PLATFORM_TARGET_OVERRIDE`` from process start: :func:`workers.isolation.child_env.child_environment_for`),
   and the worker's death taking the child with it (``PR_SET_PDEATHSIG``). With ``COMPILESVC_SANDBOX=pod``
   the pod's compile runner starts it instead, in a container without secrets (:mod:`workers.isolation.spool_process`),
   and what it left is copied out of the shared spool without following links before it is published.
   Output streams line by line into the central log (:mod:`workers.compiling.logstream`).
5. **Classify** (:func:`workers.compiling.classify.classify`).
6. **Publish** on success (:mod:`compilesvc.compiles.publishing`; an unreachable store is waited for as at fetch,
   without compiling again): every output file as a blob, the full log as a blob, then the bucket manifest
   (create-only: if an earlier attempt already published it, theirs is reused), then the ledger
   (:func:`compilesvc.compiles.leases.succeed`, fenced by the token), then any set that is now complete.
   On failure: archive the log, record the failure (:func:`compilesvc.compiles.leases.fail`), relay a requeue.

Every write to the ledger carries the lease token; a lost lease ends the attempt without recording anything
(its log lines stay in the central log, tagged with their attempt number).
Log records carry ``bucket_key``, ``bucket_compile_id``, ``attempt`` and ``worker``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from compilesvc.compiles import backoff, leases
from compilesvc.compiles.failures import ArchivedLog, Phase, shorten
from compilesvc.compiles.logs import append_lines
from compilesvc.compiles.publishing import LOG_NAME, PublishError, archive_log, publish_outputs, publish_ready_artifacts
from compilesvc.ledger.engine import transaction
from compilesvc.pinning.pins import ModelRefError
from compilesvc.services import Services
from compilesvc.spec import nxdi_models
from compilesvc.spec.manifest import BucketManifest
from compilesvc.states import ErrorClass
from compilesvc.store import StoreError, bucket_manifest_name
from workers.compiling.checkpoint_dirs import materialise_checkpoint
from workers.compiling.classify import Outcome, classify
from workers.compiling.contract import CompileFailure, ExtractLimits
from workers.compiling.drain import DRAIN, Interruptible
from workers.compiling.error_codes import for_release
from workers.compiling.launch import RESULT_NAME, AttemptDirs, compile_dirs, read_result, start_child
from workers.compiling.lease_keeper import LeaseKeeper
from workers.compiling.logstream import LogStream
from workers.compiling.retries import (
    ClaimNotRecorded,
    Interrupted,
    StoreRetriesExhausted,
    is_transient,
    retry_store,
    with_db_retry,
)
from workers.compiling.sandbox_limits import limit_outcome
from workers.compiling.workdirs import OWNER_LOCK, attempt_dirs, sweep_orphaned_attempts, work_root
from workers.isolation.sandbox import Policy
from workers.isolation.spool import copy_outputs

__all__ = ["OWNER_LOCK", "ClaimNotRecorded", "RunResult", "run_compile",
           "sweep_orphaned_attempts", "work_root"]

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when the compiler's process group is stopped.
KILL_GRACE_SECONDS = 5.0
#: Model file names by format, inside the attempt's temporary directory.
MODEL_FILE_NAMES = {"torchscript": "model.pt", "exported-program": "model.pt2", "hf-dir": "model.tar",
                    "hlo": "model.hlo.pb"}

# -- results ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunResult:
    """How :func:`run_compile` ended, for the task's return value and for tests."""

    bucket_compile_id: int
    status: str  # nothing-to-claim | succeeded | queued | failed | cancelled | lease-lost | interrupted
    attempt: int | None = None
    error_class: str | None = None
    code: str | None = None
    message: str | None = None
    manifest_uri: str | None = None


class _Ids(logging.LoggerAdapter[logging.Logger]):
    """Adds the compile's ids to every record's ``extra`` (JSON log fields)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


# -- the attempt -----------------------------------------------------------------------------------------

def run_compile(services: Services, bucket_compile_id: int, worker_id: str) -> RunResult:
    """Run one attempt of a bucket compile (see the module docstring). Never raises for compile or infra
    failures: they are recorded in the ledger. :class:`ClaimNotRecorded` means the claim never reached the
    ledger (the task must give its message back, not acknowledge it); any other exception escaping here
    means the ledger became unreachable later, and the lease's expiry brings the compile back."""

    def take() -> leases.Claim | None:
        with transaction(services.sessions) as session:
            return leases.claim(session, bucket_compile_id, worker_id, services.settings.lease_seconds)

    try:
        claim = with_db_retry(take, services.settings.ledger_retry_seconds)
    except DBAPIError as exc:
        if not is_transient(exc):  # not the ledger being away: giving the message back would only loop
            raise
        raise ClaimNotRecorded(f"could not claim bucket compile {bucket_compile_id}: {exc}") from exc
    if claim is None:
        log.info("duplicate delivery: nothing to claim",
                 extra={"bucket_compile_id": bucket_compile_id, "worker": worker_id})
        return RunResult(bucket_compile_id, "nothing-to-claim")
    ids = {"bucket_key": claim.key, "bucket_compile_id": claim.bucket_id, "attempt": claim.attempt,
           "worker": worker_id}
    logger = _Ids(log, ids)
    logger.info("compile claimed", extra={"token": claim.token, "max_attempts": claim.max_attempts,
                                          "target": claim.target, "sdk": claim.sdk, "backend": claim.backend})
    keeper = LeaseKeeper(services, claim, logger).start()
    try:
        with attempt_dirs(claim.bucket_id) as (files, work_dir), \
                compile_dirs(services.settings, claim.bucket_id, files, work_dir) as dirs:
            return _run_claimed(services, claim, worker_id, keeper, files, dirs, logger)
    except Exception as exc:
        # A bug or an unexpected library error: record it as infra (retried) rather than waiting for the
        # lease to expire, unless the ledger itself is what failed.
        logger.exception("compile attempt crashed")
        if keeper.lost:
            return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
        outcome = Outcome(ErrorClass.INFRA, "WORKER_ERROR", shorten(f"{type(exc).__name__}: {exc}"))
        return _record_failure(services, claim, outcome, logger, phase=Phase.WORKER)
    finally:
        keeper.close()


def _run_claimed(services: Services, claim: leases.Claim, worker_id: str, keeper: LeaseKeeper, tmp: Path,
                 dirs: AttemptDirs, logger: logging.LoggerAdapter[Any]) -> RunResult:
    settings = services.settings
    model_dir, out_dir, work_dir = dirs.model, dirs.out, dirs.work
    logs = LogStream(services.sessions, claim.bucket_id, claim.attempt, tmp / LOG_NAME,
                     max_bytes=settings.sandbox_max_log_mb * 1024 * 1024)
    drained = DRAIN.register()
    stop = drained.either(keeper.stop)  # the lease lost, a cancel, or the drain's window over
    try:
        handed_back = f" ({claim.interruptions} handed back before, not counted)" if claim.interruptions else ""
        logs.service(f"attempt {claim.counted} of {claim.max_attempts}{handed_back} on worker {worker_id} "
                     f"(pid {os.getpid()}): {claim.backend} for {claim.target} sdk {claim.sdk}")

        model_format = str(claim.model.get("format") or claim.material["model"]["format"])
        model_path = model_dir / MODEL_FILE_NAMES.get(model_format, "model.bin")
        limits = ExtractLimits(settings.hf_extract_max_bytes, settings.hf_extract_max_files,
                               settings.hf_extract_max_ratio)

        def fetch_model() -> None:
            nonlocal model_path
            if model_format == "hf-checkpoint":  # a directory (NxDI reads one), made here: the child gets its path
                model_path = materialise_checkpoint(services.resolver, claim.model["fetch"], model_dir, limits)
            else:
                services.resolver.fetch(claim.model["fetch"], model_path)

        fetch_started = time.monotonic()
        try:
            retry_store(services, claim, stop, Phase.FETCH, fetch_model, logger)
        except ModelRefError as exc:  # gone or changed since it was pinned: only a new submit's new pin helps
            return _fail(services, claim, Outcome(ErrorClass.MODEL, "MODEL_UNAVAILABLE", str(exc)), logs, logger,
                         phase=Phase.FETCH)
        except CompileFailure as exc:  # a checkpoint archive past the extraction caps, or unsafe: the model's
            return _fail(services, claim, Outcome(exc.error_class, exc.code, exc.message), logs, logger,
                         phase=Phase.FETCH)
        except (StoreRetriesExhausted, StoreError, OSError) as exc:
            error = str(exc) if isinstance(exc, StoreRetriesExhausted) else f"{type(exc).__name__}: {exc}"
            return _fail(services, claim, Outcome(ErrorClass.INFRA, "MODEL_FETCH_FAILED", error), logs, logger,
                         phase=Phase.FETCH)
        except Interrupted:
            return _stopped(services, claim, worker_id, keeper, drained, logs, logger)
        logs.service(f"fetched model sha256:{claim.model.get('sha256')} ({claim.model.get('size')} bytes"
                     f"{', a checkpoint directory' if model_path.is_dir() else ''}) in "
                     f"{time.monotonic() - fetch_started:.1f}s")
        if stop.is_set():
            return _stopped(services, claim, worker_id, keeper, drained, logs, logger)

        toolchain = claim.material.get("toolchain", {})
        request = {
            "backend": claim.backend, "target": claim.target, "sdk": claim.sdk, "model_path": str(model_path),
            "model_format": model_format, "inputs": claim.inputs, "args": list(claim.material.get("flags", [])),
            "tp_degree": int(toolchain.get("tp_degree", 1)), "isa": toolchain.get("isa"), "lnc": toolchain.get("lnc"),
            "out_dir": str(out_dir), "work_dir": str(work_dir),
            # A host setting, not key material: the child's environment carries no COMPILESVC_* variables.
            "max_parallel_rank_compiles": settings.neuron_max_parallel_rank_compiles,
            "extract_limits": {"max_bytes": settings.hf_extract_max_bytes, "max_files": settings.hf_extract_max_files,
                               "max_ratio": settings.hf_extract_max_ratio},
        }
        if claim.backend == "nxdi":  # the canonical NeuronConfig the key holds, and the hub's class for the model
            request["neuron_config"] = claim.material.get("neuron_config")
            request["nxdi_model"] = nxdi_models.class_path(claim.sdk, claim.material["model"]["config"])
        request_path = dirs.request
        dirs.staged(request_path).write_text(json.dumps(request, indent=1, sort_keys=True))

        policy = Policy.from_settings(settings)
        started = time.monotonic()
        child = start_child(settings, claim, dirs, tmp, logs, policy)
        logger.info("compiler started", extra={"pid": child.pid, "sandboxed": settings.sandbox != "off",
                                               "job_dir": str(dirs.spooled.dir if dirs.spooled else tmp)})
        returncode, timed_out = child.wait(settings.compile_timeout_seconds, stop, KILL_GRACE_SECONDS)
        DRAIN.release(drained)  # compiled (or stopped): from here on, the output is worth publishing
        wall = time.monotonic() - started
        result = read_result(work_dir / RESULT_NAME)
        if keeper.lost:
            logs.service(f"lease lost after {wall:.1f}s: the compile belongs to another attempt now")
            logs.close()
            return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
        outcome = classify(returncode, result, list(logs.tail), timed_out, keeper.cancelled)
        if drained.interrupted and not outcome.ok and not keeper.cancelled:
            logs.service(f"stopped after {wall:.1f}s: the worker is draining and the compile did not fit in its "
                         "drain window")
            return _hand_back(services, claim, worker_id, logs, logger)
        if settings.sandbox != "off" and not outcome.ok:
            outcome = limit_outcome(outcome, child.limit, returncode, list(logs.tail), policy.limits)
        if child.lost is not None and not (keeper.cancelled or timed_out):  # the runner's failing, not the model's
            outcome = Outcome(ErrorClass.INFRA, "COMPILE_RUNNER_LOST", child.lost)
        outcome = for_release(outcome, claim.sdk)  # a code the release notes call non-deterministic: one retry
        logger.info("compiler finished", extra={"returncode": returncode, "seconds": round(wall, 2),
                                                "error_class": outcome.error_class, "code": outcome.code})
        logs.service(f"compiler exited with {returncode} after {wall:.1f}s: "
                     f"{'ok' if outcome.ok else f'{outcome.error_class} {outcome.code}: {outcome.message}'}")
        if not outcome.ok or result is None:
            return _fail(services, claim, outcome, logs, logger)
        result.setdefault("compile_seconds", round(wall, 3))
        if dirs.spooled is not None:
            try:  # publish the worker's own copy: no link the compile left is followed, no file changes later
                out_dir = copy_outputs(out_dir, result, tmp / "out")
            except OSError as exc:
                return _fail(services, claim, Outcome(ErrorClass.COMPILE, "BAD_OUTPUT", shorten(str(exc))), logs,
                             logger)
        return _succeed(services, claim, worker_id, out_dir, result, keeper, logs, logger)
    finally:
        DRAIN.release(drained)
        logs.close()


def _stopped(services: Services, claim: leases.Claim, worker_id: str, keeper: LeaseKeeper, drained: Interruptible,
             logs: LogStream, logger: logging.LoggerAdapter[Any]) -> RunResult:
    if keeper.lost:
        logs.close()
        return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
    if drained.interrupted and not keeper.cancelled:
        logs.service("stopped before the compiler started: the worker is draining")
        return _hand_back(services, claim, worker_id, logs, logger)
    return _fail(services, claim, Outcome(ErrorClass.CANCELLED, "CANCELLED", "cancelled before the compiler started"),
                 logs, logger)


def _hand_back(services: Services, claim: leases.Claim, worker_id: str, logs: LogStream,
               logger: logging.LoggerAdapter[Any]) -> RunResult:
    """Requeue the compile at once, this attempt not counted (:mod:`workers.compiling.drain`)."""
    logs.service("handed back to the queue: another worker starts it now; this attempt is not counted")
    logs.close()

    def record() -> leases.Outcome | None:
        with transaction(services.sessions) as session:
            return leases.interrupt(session, claim.bucket_id, claim.token, f"worker {worker_id} {DRAIN.why}")

    settled = with_db_retry(record, services.settings.ledger_retry_seconds)
    if settled is None:
        return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
    logger.warning("compile handed back", extra={"new_state": settled.state})
    if settled.outbox_id is not None:
        services.relay.after_commit([settled.outbox_id], bucket_compile_id=claim.bucket_id)
    return RunResult(claim.bucket_id, "interrupted" if settled.state == "queued" else settled.state, claim.attempt)


def _succeed(services: Services, claim: leases.Claim, worker_id: str, out_dir: Path, result: dict[str, Any],
             keeper: LeaseKeeper, logs: LogStream, logger: logging.LoggerAdapter[Any]) -> RunResult:
    logs.service("publishing")
    logs.close()

    def publish() -> BucketManifest:
        log_entry = archive_log(services.store, logs_path=logs.log_path, bucket_id=claim.bucket_id)
        return publish_outputs(services.store, claim, out_dir, result, log_entry, worker_id)

    try:
        # A store outage is retried here, with the lease kept: the compiled output is on this worker, and a new
        # attempt would compile again (hours, for Neuron).
        manifest = retry_store(services, claim, keeper.stop, Phase.PUBLISH, publish, logger)
    except PublishError as exc:
        return _record_failure(services, claim, Outcome(ErrorClass.INFRA, "BAD_RESULT", str(exc)), logger,
                               phase=Phase.PUBLISH)
    except (StoreRetriesExhausted, StoreError, OSError) as exc:
        error = str(exc) if isinstance(exc, StoreRetriesExhausted) else f"{type(exc).__name__}: {exc}"
        return _record_failure(services, claim, Outcome(ErrorClass.INFRA, "PUBLISH_FAILED", error), logger,
                               phase=Phase.PUBLISH)
    except Interrupted:
        if keeper.lost:
            return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
        cancelled = Outcome(ErrorClass.CANCELLED, "CANCELLED", "cancelled while publishing")
        return _record_failure(services, claim, cancelled, logger, phase=Phase.PUBLISH)
    name = bucket_manifest_name(claim.key)
    manifest_uri = services.store.document_location(name)
    if keeper.lost:  # published files are harmless (content-addressed, same key); the record is not ours
        return RunResult(claim.bucket_id, "lease-lost", claim.attempt)

    def record() -> bool:
        with transaction(services.sessions) as session:
            return leases.succeed(session, claim.bucket_id, claim.token, manifest_uri, manifest.versions,
                                  manifest.compile_seconds)

    if not with_db_retry(record, services.settings.ledger_retry_seconds):
        logger.warning("lease lost before the success was recorded; another attempt owns the compile")
        return RunResult(claim.bucket_id, "lease-lost", claim.attempt)
    logger.info("compile succeeded", extra={"manifest": manifest_uri, "files": len(manifest.files),
                                            "compile_seconds": manifest.compile_seconds})
    try:
        publish_ready_artifacts(services.store, services.sessions, claim.bucket_id, signer=services.signer)
    except StoreError as exc:  # the bucket is recorded; the reaper publishes the set when the store is back
        logger.warning("publishing complete artifacts failed", extra={"error": str(exc)})
    return RunResult(claim.bucket_id, "succeeded", claim.attempt, manifest_uri=manifest_uri)


def _fail(services: Services, claim: leases.Claim, outcome: Outcome, logs: LogStream,
          logger: logging.LoggerAdapter[Any], *, phase: str = Phase.COMPILE) -> RunResult:
    """Archive the log (naming its blob in the central log), then record the failure."""
    logs.service(f"{outcome.error_class} error {outcome.code}: {outcome.message}")
    logs.close()
    entry = archive_log(services.store, logs_path=logs.log_path, bucket_id=claim.bucket_id)
    if entry is not None:
        logger.info("compile log archived", extra={"log_sha256": entry.sha256})
        try:
            with transaction(services.sessions) as session:
                append_lines(session, claim.bucket_id, claim.attempt,
                             [f"full log archived as blob sha256:{entry.sha256} ({entry.size} bytes)"],
                             stream="service")
        except Exception as exc:  # the failure record below matters more than this line
            logger.warning("could not write the log-archive line", extra={"error": str(exc)})
    archived = ArchivedLog(entry.sha256, entry.size) if entry is not None else None
    return _record_failure(services, claim, outcome, logger, phase=phase, log=archived)


def _record_failure(services: Services, claim: leases.Claim, outcome: Outcome, logger: logging.LoggerAdapter[Any],
                    *, phase: str, log: ArchivedLog | None = None) -> RunResult:
    error_class = outcome.error_class or "infra"
    retry_in = backoff.for_settings(services.settings, claim.attempt)

    def record() -> leases.Outcome | None:
        with transaction(services.sessions) as session:
            return leases.fail(session, claim.bucket_id, claim.token, error_class, outcome.code, outcome.message,
                               phase=phase, backoff_seconds=retry_in,
                               unknown_retries=services.settings.unknown_failure_retries, archived=log,
                               retry_once=outcome.retry_once)

    settled = with_db_retry(record, services.settings.ledger_retry_seconds)
    if settled is None:
        logger.warning("lease lost before the failure was recorded; another attempt owns the compile")
        return RunResult(claim.bucket_id, "lease-lost", claim.attempt, error_class, outcome.code, outcome.message)
    logger.info("compile attempt failed", extra={"error_class": error_class, "code": outcome.code,
                                                 "new_state": settled.state, "retry_in": round(settled.retry_in, 1)})
    if settled.outbox_id is not None and not settled.retry_in:
        services.relay.after_commit([settled.outbox_id], bucket_compile_id=claim.bucket_id)
    return RunResult(claim.bucket_id, settled.state, claim.attempt, error_class, outcome.code, outcome.message)
