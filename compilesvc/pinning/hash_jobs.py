"""Background hashing of large S3 model objects for their pins.

A submit (or resolve) that finds an object larger than ``pin_inline_hash_max_mb``, neither remembered in
``model_pins`` nor carrying S3's own SHA-256, must not stream it through sha256 inside the request: a 140 GB
checkpoint would hold an API worker for minutes and the client would time out. Instead the request records a job
(``pin_jobs``: one row per object identity, keyed as ``model_pins`` is) and answers
:class:`~compilesvc.pinning.pins.ModelPinning` (503 ``model-pinning``, with the progress). One API process claims
the job with a lease (a conditional update the ledger decides, as campaign items are claimed) and hashes the
object in a thread of its own, renewing the lease and recording the bytes read as it goes; a job whose process
died is claimed again by the next request for the object once its lease expires. The sha256 lands in
``model_pins`` (where every later pin finds it) and the job is ``done``; an object that changed or became
unreadable while it streamed makes the job ``failed``, with the reason the next request answers (a 422) for a
lease's time, after which it is tried again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import PinJob, utcnow
from compilesvc.ledger.sql import insert_ignore_duplicate
from compilesvc.pinning.pins import ModelPinning, ModelRefError
from compilesvc.pinning.s3_models import ObjectChanged

if TYPE_CHECKING:
    from compilesvc.pinning.s3_models import S3Models

log = logging.getLogger(__name__)

HASHING, DONE, FAILED = "hashing", "done", "failed"
#: Objects one process hashes at once: more would share its bandwidth, not finish sooner. A job left unclaimed
#: is claimed by a later request for it (the waiting client asks again every few seconds).
MAX_HASHERS = 4
#: How often a hasher records its progress (and renews its lease, at least four times a lease).
PROGRESS_SECONDS = 5.0
#: Failed reads in a row after which a job fails (with the store's reason) instead of starting over.
STORE_ATTEMPTS = 3
#: Only for the Retry-After estimate.
_ASSUMED_BYTES_PER_SECOND = 200 * 1024**2


@dataclass(frozen=True)
class ObjectVersion:
    """One immutable S3 object as a pin names it."""

    bucket: str
    key: str
    version_id: str | None
    etag: str
    size: int

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def identity(self) -> dict[str, Any]:
        return {"uri": self.uri, "version_id": self.version_id or "", "etag": self.etag, "size": self.size}


@dataclass(frozen=True)
class Progress:
    """A job still hashing: ``done`` of ``total`` bytes read."""

    done: int
    total: int


def pinning(what: str, waiting: list[Progress]) -> ModelPinning:
    """The answer for a pin waiting on ``waiting`` (one object's job, or a checkpoint's weight files')."""
    done, total = sum(p.done for p in waiting), sum(p.total for p in waiting)
    retry_after = int(min(30.0, max(2.0, (total - done) / _ASSUMED_BYTES_PER_SECOND)))
    return ModelPinning(what, done, total, retry_after)


class _LeaseLost(Exception):
    """Another process took the job over (this one stalled past its lease): stop reading."""


class HashJobs:
    """The background hashes of one process (thread-safe; one per :class:`S3Models`)."""

    def __init__(self, s3: S3Models, sessions: sessionmaker[Session], lease_seconds: float):
        self.s3 = s3
        self.sessions = sessions
        self.lease_seconds = lease_seconds
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._slots = threading.BoundedSemaphore(MAX_HASHERS)

    def sha256(self, obj: ObjectVersion) -> str | Progress:
        """``obj``'s sha256 if its job is done; else the job's progress, the job recorded and claimed here when
        nobody (alive) hashes it. A job that failed lately raises its reason as :class:`ModelRefError`."""
        now = utcnow()
        job = self._job(obj)
        if job is None:  # the first request naming it (clients waiting on it poll: no write for each of those)
            with transaction(self.sessions) as session:
                insert_ignore_duplicate(session, PinJob, {**obj.identity(), "state": HASHING, "bytes_done": 0,
                                                          "created_at": now, "updated_at": now},
                                        ["uri", "version_id", "etag", "size"])
            job = self._job(obj)
            assert job is not None
        if job.state == DONE:
            return str(job.sha256)
        if job.state == FAILED and job.updated_at > now - timedelta(seconds=self.lease_seconds):
            raise ModelRefError(str(job.error))
        self._start(job.id, obj)
        return Progress(int(job.bytes_done) if job.state == HASHING else 0, obj.size)

    def _job(self, obj: ObjectVersion) -> Any:
        with self.sessions() as session:
            return session.execute(select(PinJob.id, PinJob.state, PinJob.sha256, PinJob.error, PinJob.bytes_done,
                                          PinJob.updated_at).where(*self._identity(obj))).one_or_none()

    @staticmethod
    def _identity(obj: ObjectVersion) -> tuple[ColumnElement[bool], ...]:
        return (PinJob.uri == obj.uri, PinJob.version_id == (obj.version_id or ""), PinJob.etag == obj.etag,
                PinJob.size == obj.size)

    def _start(self, job_id: int, obj: ObjectVersion) -> None:
        if not self._slots.acquire(blocking=False):
            return  # this process hashes enough already: a later request (here or elsewhere) claims it
        try:
            claimed = self.claim(job_id)
        except BaseException:
            self._slots.release()
            raise
        if not claimed:
            self._slots.release()
            return
        threading.Thread(target=self._run, args=(job_id, obj), name=f"pin-hash-{job_id}", daemon=True).start()

    def claim(self, job_id: int) -> bool:
        """Take job ``job_id`` if nobody holds it: never claimed, its hasher's lease expired, or it failed more
        than a lease ago (tried again). The ledger decides between processes claiming it at once."""
        now = utcnow()
        lease = timedelta(seconds=self.lease_seconds)
        free = (PinJob.state == HASHING) & (PinJob.lease_until.is_(None) | (PinJob.lease_until < now))
        stale_failure = (PinJob.state == FAILED) & (PinJob.updated_at < now - lease)
        with transaction(self.sessions) as session:
            claimed = session.execute(
                update(PinJob).where(PinJob.id == job_id, free | stale_failure)
                .values(state=HASHING, owner=self.owner, lease_until=now + lease, bytes_done=0, error=None,
                        updated_at=now)
                .execution_options(synchronize_session=False))
            return bool(getattr(claimed, "rowcount", 0) == 1)

    def _update(self, job_id: int, **values: Any) -> bool:
        """Write ``values`` to the job while this process holds it; False when another took it over."""
        with transaction(self.sessions) as session:
            updated = session.execute(
                update(PinJob).where(PinJob.id == job_id, PinJob.owner == self.owner, PinJob.state == HASHING)
                .values(updated_at=utcnow(), **values).execution_options(synchronize_session=False))
            return bool(getattr(updated, "rowcount", 0) == 1)

    def _run(self, job_id: int, obj: ObjectVersion) -> None:
        try:
            self.hash(job_id, obj)
        except Exception:  # the ledger failed: the lease runs out and another request claims the job
            log.exception("background hash failed", extra={"uri": obj.uri, "job_id": job_id})
        finally:
            self._slots.release()

    def hash(self, job_id: int, obj: ObjectVersion) -> None:
        """Hash the claimed job's object, renewing the lease with the progress, and settle the job."""
        every = min(PROGRESS_SECONDS, self.lease_seconds / 4)
        read, next_beat = 0, time.monotonic() + every

        def progress(chunk: bytes) -> None:
            nonlocal read, next_beat
            read += len(chunk)
            if time.monotonic() >= next_beat:
                lease_until = utcnow() + timedelta(seconds=self.lease_seconds)
                if not self._update(job_id, bytes_done=read, lease_until=lease_until):
                    raise _LeaseLost()
                next_beat = time.monotonic() + every

        which = f"version {obj.version_id}" if obj.version_id else f"ETag {obj.etag}"
        try:
            sha256, size = self.s3.stream(obj.bucket, obj.key, obj.version_id, obj.etag, obj.size, sink=progress)
            if size != obj.size:
                raise ObjectChanged()
        except _LeaseLost:
            log.warning("background hash taken over by another process", extra={"uri": obj.uri, "job_id": job_id})
            return
        except ObjectChanged:
            self._update(job_id, state=FAILED, lease_until=None,
                         error=f"{obj.uri} changed while it was being hashed ({which} is gone); submit again to pin "
                               "the object as it is now")
            return
        except ModelRefError as exc:  # access denied since it was listed
            self._update(job_id, state=FAILED, lease_until=None, error=exc.message)
            return
        except Exception as exc:  # S3 unavailable or refusing the read: see _read_failed
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("background hash failed", extra={"uri": obj.uri, "error": reason})
            self._read_failed(job_id, obj, reason)
            return
        self.s3.remember_pin(obj.uri, obj.version_id, obj.etag, obj.size, sha256)
        self._update(job_id, state=DONE, sha256=sha256, bytes_done=size, lease_until=None, store_failures=0)

    def _read_failed(self, job_id: int, obj: ObjectVersion, reason: str) -> None:
        """A read that failed: released at once for the next request to try again, unless it failed
        :data:`STORE_ATTEMPTS` times in a row. A store that keeps refusing the object (an SSE-C object, a 400)
        would otherwise look like progress restarting from byte 0 forever to a client waiting for hours: then
        the job fails with the reason, which the next requests answer (a 422) for a lease's time."""
        with transaction(self.sessions) as session:
            job = session.get(PinJob, job_id, with_for_update=True)
            if job is None or job.owner != self.owner or job.state != HASHING:
                return  # taken over meanwhile
            job.store_failures += 1
            job.lease_until, job.bytes_done, job.updated_at = None, 0, utcnow()
            if job.store_failures >= STORE_ATTEMPTS:
                job.state, job.store_failures = FAILED, 0
                job.error = (f"reading {obj.uri} failed {STORE_ATTEMPTS} times in a row ({reason}); check that the "
                             "service can read it, then submit again")
            else:
                job.owner = None
