"""The lease heartbeat of one compile attempt: a thread that renews the claim's lease and tells the attempt
when it must stop (the lease was lost, or a user cancelled the build).

Why a lease at all, and how it is fenced: :mod:`compilesvc.compiles.leases`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from compilesvc.compiles import leases
from compilesvc.ledger.engine import transaction
from compilesvc.services import Services


class LeaseKeeper:
    """Renews a claim's lease from a thread; sets :attr:`stop` when the compile must stop.

    ``lost`` means another attempt owns the compile now (or we could not prove ownership for a whole
    lease period, e.g. the database was unreachable: by then the reaper may have requeued it), and the
    attempt must not write anything more. ``cancelled`` means a user cancelled the build.
    """

    def __init__(self, services: Services, claim: leases.Claim, logger: logging.LoggerAdapter[Any]):
        self._services = services
        self._claim = claim
        self._log = logger
        self.interval = services.settings.heartbeat_seconds
        self.lease_seconds = services.settings.lease_seconds
        self.stop = threading.Event()
        self.lost = False
        self.cancelled = False
        self._halt = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lease-{claim.bucket_id}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def close(self) -> None:
        self._halt.set()
        self._thread.join(self.interval + 30)

    def renew_once(self) -> None:
        try:
            with transaction(self._services.sessions) as session:
                renewal = leases.renew(session, self._claim.bucket_id, self._claim.token, self.lease_seconds)
        except Exception as exc:  # the database is away: keep compiling until the lease would have run out
            silent = time.monotonic() - self._last_ok
            self._log.warning("lease renewal failed", extra={"error": f"{type(exc).__name__}: {exc}",
                                                            "seconds_since_renewal": round(silent, 1)})
            if silent > self.lease_seconds:
                self._lose("could not renew the lease for a whole lease period")
            return
        self._last_ok = time.monotonic()
        if not renewal.still_ours:
            self._lose("the lease was taken back (the compile was requeued or finished elsewhere)")
        elif renewal.cancel_requested and not self.cancelled:
            self.cancelled = True
            self._log.info("cancel requested: stopping the compiler")
            self.stop.set()

    def _lose(self, why: str) -> None:
        if not self.lost:
            self.lost = True
            self._log.warning("lease lost", extra={"reason": why})
            self.stop.set()

    def _run(self) -> None:
        while not self._halt.wait(self.interval):
            self.renew_once()
            if self.lost:
                return
