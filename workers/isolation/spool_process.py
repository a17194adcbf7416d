"""The worker's side of ``COMPILESVC_SANDBOX=pod``: a compile attempt handed to the pod's compile runner
(:mod:`workers.isolation.compile_runner`) through the spool (:mod:`workers.isolation.spool`), behind the interface of
:class:`workers.isolation.compiler_process.CompilerProcess` (``wait``, ``limit``, ``lost``, ``pid``), so the runner
(:mod:`workers.compiling.runner`) drives both alike.

The worker lays the attempt out (its model under ``models/``, which the compile container mounts read-only:
a compile cannot change the bytes a later look at them would see; each attempt fetches its own copy, and
the worker keeps no model cache the compile could reach), hands it over by renaming it into place, tails
the runner's log file into the attempt's :class:`workers.compiling.logstream.LogStream`, asks for a cancel (a file)
on a cancel or at the time limit, and reads the runner's exit status. A runner that does not take the
attempt within ``COMPILESVC_COMPILE_RUNNER_PICKUP_SECONDS``, whose heartbeat stops for
``COMPILESVC_COMPILE_RUNNER_STALE_SECONDS``, or that never reports, makes the attempt an infrastructure
failure (retried): :attr:`SpoolProcess.lost`. Afterwards the attempt's spool directories are wiped
(:func:`workers.isolation.spool.wipe`); what the worker publishes it first copies out of the spool without
following links (:func:`workers.isolation.spool.copy_regular`).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from workers.isolation.compiler_process import OutputSink, StopSignal
from workers.isolation.sandbox import Limits
from workers.isolation.spool import (
    ATTEMPTS,
    CANCEL,
    CHILD_DIRS,
    CLAIMED,
    CONTROL,
    LOG,
    MODELS,
    REQUEST,
    RUN,
    STAGING_PREFIX,
    STATUS,
    heartbeat_age,
    open_regular,
    read_document,
    wipe,
    write_document,
)

POLL_SECONDS = 0.1
#: After asking for a cancel, how long past the kill grace the runner has to report.
REPORT_SECONDS = 15.0


class SpoolUnavailable(RuntimeError):
    """The spool or its runner cannot be used; the message says why."""


class SpoolAttempt:
    """One attempt's directories in the spool (paths as both containers see them)."""

    def __init__(self, spool: Path, bucket_id: int):
        self.spool = spool
        self.name = f"{bucket_id}-{secrets.token_hex(8)}"
        self.dir = spool / ATTEMPTS / self.name
        self.staging = spool / ATTEMPTS / f"{STAGING_PREFIX}{self.name}"
        self.model_dir = spool / MODELS / self.name
        self.work, self.out, self.tmp = (self.dir / name for name in CHILD_DIRS)
        self.request = self.dir / REQUEST
        self.run = self.dir / RUN

    def create(self) -> None:
        """Lay out the staging directory and the model directory. ``mkdir`` refuses a name that exists: a
        leftover the worker did not create is never taken for its own."""
        for part in (ATTEMPTS, MODELS):
            (self.spool / part).mkdir(mode=0o755, exist_ok=True)
        os.mkdir(self.staging, 0o755)
        for name in (*CHILD_DIRS, RUN):
            os.mkdir(self.staging / name, 0o755)
        os.mkdir(self.model_dir, 0o755)

    def staged(self, path: Path) -> Path:
        """Where ``path`` (under :attr:`dir`) is while the attempt is being laid out."""
        return self.staging / path.relative_to(self.dir)

    def hand_over(self, control: dict[str, Any]) -> None:
        """Write the control document and rename the attempt into place: the runner sees it complete."""
        for path in self.model_dir.iterdir():
            path.chmod(0o444)
        write_document(self.staging / CONTROL, control)
        os.rename(self.staging, self.dir)

    def wipe(self) -> None:
        for path in (self.staging, self.dir, self.model_dir):
            wipe(path)


@contextmanager
def spool_attempt(spool: Path, bucket_id: int) -> Iterator[SpoolAttempt]:
    """A fresh :class:`SpoolAttempt`, wiped afterwards whatever happened."""
    attempt = SpoolAttempt(spool, bucket_id)
    try:
        attempt.create()
        yield attempt
    finally:
        attempt.wipe()


def sweep_spool(spool: Path) -> list[str]:
    """Remove every attempt and model in the spool: at worker start none is this worker's (one worker per
    pod), so anything there is a dead worker's leftover or something the compile container planted."""
    removed = []
    for part in (ATTEMPTS, MODELS):
        (spool / part).mkdir(parents=True, exist_ok=True)
        for name in os.listdir(spool / part):
            wipe(spool / part / name)
            removed.append(f"{part}/{name}")
    return removed


class _Tail:
    """A growing file read as a stream: ``readline`` waits for more until the writer is done."""

    def __init__(self, path: Path, done: threading.Event):
        self.path = path
        self.done = done
        self._fh: IO[bytes] | None = None

    def readline(self, limit: int) -> bytes:
        line = b""
        while True:
            if self._fh is None:
                try:
                    self._fh = os.fdopen(open_regular(self.path), "rb")
                except OSError:
                    if self.done.is_set():
                        return line
                    time.sleep(POLL_SECONDS)
                    continue
            finished = self.done.is_set()  # before reading: what is read after it is all there is
            line += self._fh.readline(limit - len(line))
            if line.endswith(b"\n") or len(line) >= limit or (finished and line):
                return line
            if finished:
                self._fh.close()
                return b""
            time.sleep(POLL_SECONDS)


class SpoolProcess:
    """An attempt run by the pod's compile runner, waited for like a :class:`CompilerProcess`."""

    def __init__(self, attempt: SpoolAttempt, *, logs: OutputSink, limits: Limits, timeout: float, target: str,
                 max_log_bytes: int, pickup_seconds: float, stale_seconds: float, probe: bool = False):
        self.attempt = attempt
        self.pickup_seconds = pickup_seconds
        self.stale_seconds = stale_seconds
        self.limit: tuple[str, str] | None = None
        self.lost: str | None = None
        self.pid: int | None = None  # the runner's child is in another container
        self.status: dict[str, Any] | None = None
        attempt.hand_over({"limits": vars(limits), "timeout_seconds": timeout, "target": target,
                           "max_log_bytes": max_log_bytes, "probe": probe})
        self._handed_at = time.monotonic()
        self._done = threading.Event()
        self._reader = threading.Thread(target=logs.pump, args=(_Tail(attempt.run / LOG, self._done),),
                                        name=f"tail-{attempt.name}", daemon=True)
        self._reader.start()

    def _gone(self) -> str | None:
        """Why the runner cannot be counted on for this attempt any more, if it cannot."""
        age = heartbeat_age(self.attempt.spool)
        waited = time.monotonic() - self._handed_at
        if age is None and waited > self.pickup_seconds:  # a runner just starting has not beaten yet
            return (f"the compile runner never wrote its heartbeat within {self.pickup_seconds:g}s "
                    f"(COMPILESVC_COMPILE_RUNNER_PICKUP_SECONDS): it is not running")
        if age is not None and age > self.stale_seconds:
            return (f"the compile runner's heartbeat is {age:.0f}s old "
                    f"(COMPILESVC_COMPILE_RUNNER_STALE_SECONDS={self.stale_seconds:g}): it stopped")
        if not os.path.lexists(self.attempt.run / CLAIMED) and waited > self.pickup_seconds:
            return (f"the compile runner did not take the attempt within {self.pickup_seconds:g}s "
                    f"(COMPILESVC_COMPILE_RUNNER_PICKUP_SECONDS)")
        return None

    def wait(self, timeout: float, stop: StopSignal, grace: float) -> tuple[int, bool]:
        """Wait for the runner's report; ask it to stop the compile on ``stop`` or after ``timeout``
        seconds. Returns ``(returncode, timed_out)``; :attr:`lost` says when the runner failed instead."""
        deadline = time.monotonic() + timeout
        report_by: float | None = None
        timed_out = False
        while True:
            self.status = read_document(self.attempt.run / STATUS)
            if self.status is not None:
                break
            now = time.monotonic()
            if report_by is None and (stop.is_set() or now >= deadline):
                timed_out = not stop.is_set()
                write_document(self.attempt.dir / CANCEL, {"at": time.time()})
                report_by = now + grace + REPORT_SECONDS
            self.lost = self._gone() or (
                "the compile runner did not report after it was asked to stop"
                if report_by is not None and now > report_by else None)
            if self.lost is not None:
                break
            time.sleep(POLL_SECONDS)
        self._done.set()
        self._reader.join(10)
        status = self.status or {}
        limit = status.get("limit")
        if isinstance(limit, list) and len(limit) == 2 and all(isinstance(x, str) for x in limit):
            self.limit = (limit[0], limit[1])
        returncode = status.get("returncode")
        if self.status is not None and not isinstance(returncode, int):
            self.lost = f"the compile runner reported no exit status ({str(status.get('error'))[:200]})"
        return (returncode if isinstance(returncode, int) else -9), timed_out


class _Discard:
    def pump(self, stream: Any) -> None:
        while stream.readline(1 << 16):
            pass


def probe(spool: Path, limits: Limits, *, pickup_seconds: float, stale_seconds: float) -> int:
    """Hand the runner an attempt that only starts the interpreter as a compile would; raise
    :class:`SpoolUnavailable` naming the reason if it does not answer or the interpreter fails. Returns the
    Neuron devices the runner's container has (``/dev/neuron*`` there: the pod split gives the devices to the
    compile container, so the worker's own container has none), 0 when it does not say."""
    if not spool.is_dir():
        raise SpoolUnavailable(f"COMPILESVC_COMPILE_SPOOL={spool}: no such directory (mount the spool volume "
                               f"shared with the compile container there)")
    with spool_attempt(spool, 0) as attempt:
        process = SpoolProcess(attempt, logs=_Discard(), limits=limits, timeout=120, target="cpu",
                               max_log_bytes=1 << 20, pickup_seconds=pickup_seconds, stale_seconds=stale_seconds,
                               probe=True)
        returncode, _ = process.wait(120, threading.Event(), 5)
    if process.lost is not None:
        raise SpoolUnavailable(process.lost)
    if returncode != 0:
        raise SpoolUnavailable(f"the compile runner could not start the interpreter (exit {returncode})")
    devices = (process.status or {}).get("devices")
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and 0 <= devices <= 1024 else 0
