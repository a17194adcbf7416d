"""The per-token submit rate, counted with the ``limits`` library.

Each token may submit ``submit_rate_limit`` times (e.g. ``120/minute``) in a sliding window; past it, the
submit is answered 429 ``rate-limited`` with ``Retry-After`` before its body is read. The counters live in
Redis when the broker is Redis (every API process counts together, under the broker's key prefix), else in
the process (the embedded default).

A limiter whose Redis is away lets submits through, says so in the log, and does not ask Redis again for
half a minute: the outbox keeps submits safe through a broker outage, and the limiter must neither undo
that nor make every submit wait for a connection timeout.

Why not Flask-Limiter (which wraps the same ``limits``): with it, ``python -m bench.api_throughput
--duration 4`` measured the cache-hit submit at 1633 µs of server CPU per request (0.25x static); with the
strategy called directly, 1151 µs (0.34x), as before any limit. The check itself, a sliding-window
``hit`` in memory, costs about 4 µs (``python -m timeit``); with Redis, one round trip.

In memory, ``limits``' own storage starts a thread (a 10 ms ``threading.Timer`` that frees expired counters)
on every count that finds the last one finished: under a steady stream of submits, a new thread every ten
milliseconds or so, which a profile of cache-hit submits showed as their largest single cost (a tight
``timeit`` loop never sees it: its timer is always alive). :class:`_MemoryCounters` frees them from one
long-lived thread instead; reads expire counters by themselves (``MemoryStorage.get``), so only memory waits.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

from limits import parse_many
from limits.storage import MemoryStorage, Storage, storage_from_string
from limits.strategies import SlidingWindowCounterRateLimiter

from compilesvc.access.tokens import Principal
from compilesvc.config.settings import Settings
from web.contract.problems import Problem

log = logging.getLogger(__name__)

#: After a failure of the counters' store, submits are not limited for this long.
STORE_DOWN_SECONDS = 30.0


#: How often the in-memory counters are swept of expired entries (a read never sees one either way).
SWEEP_SECONDS = 5.0


class _MemoryCounters(MemoryStorage):
    """``limits``' in-memory storage, swept by one daemon thread instead of a new thread per count."""

    def __init__(self) -> None:
        super().__init__()
        # The sweeper holds the counters weakly: it ends with them (an app made and dropped, as tests do).
        threading.Thread(target=_sweep, args=(weakref.ref(self),), name="rate-limit-sweeper", daemon=True).start()

    def _MemoryStorage__schedule_expiry(self) -> None:  # replaces the base class's private per-count scheduler
        pass


def _sweep(counters: weakref.ref[_MemoryCounters]) -> None:
    while True:
        time.sleep(SWEEP_SECONDS)
        alive = counters()
        if alive is None:
            return
        try:
            alive._MemoryStorage__expire_events()  # type: ignore[attr-defined]
        except Exception:  # a count expired by a read meanwhile (MemoryStorage.get): sweep again next time
            log.debug("rate-limit sweep interrupted", exc_info=True)
        del alive


def storage_uri(settings: Settings) -> str:
    broker = settings.resolved_broker_url
    return broker if broker.startswith(("redis://", "rediss://")) else "memory://"


class SubmitLimiter:
    """``check(principal)`` before a submit is read: a 429 :class:`Problem` past the token's rate."""

    def __init__(self, settings: Settings):
        self.limits = parse_many(settings.submit_rate_limit)
        uri = storage_uri(settings)
        # A Redis that hangs must not hang submits: its commands time out like the broker's publishes. Its keys
        # are all under the deployment's prefix.
        storage: Storage
        if uri == "memory://":
            storage = _MemoryCounters()
        else:
            made = storage_from_string(uri, socket_timeout=settings.broker_socket_timeout_seconds,
                                       socket_connect_timeout=2.0,
                                       key_prefix=f"{settings.broker_key_prefix}compilesvc-limits")
            if not isinstance(made, Storage):  # storage_uri names only synchronous storages: never taken
                raise TypeError(f"the rate limits' storage {uri.split(':', 1)[0]}:// is not a synchronous one")
            storage = made
        self.strategy = SlidingWindowCounterRateLimiter(storage)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def check(self, principal: Principal | None) -> None:
        if principal is None or time.monotonic() < self._down_until:
            return
        key = str(principal.token_id)
        for limit in self.limits:
            try:
                allowed = self.strategy.hit(limit, "submit", key)
                if allowed:
                    continue
                reset_at = self.strategy.get_window_stats(limit, "submit", key).reset_time
            except Exception as exc:  # the counters' store is away: let submits through for a while
                with self._lock:
                    self._down_until = time.monotonic() + STORE_DOWN_SECONDS
                log.warning("submit rate limiter store unavailable; not limiting for %.0f s", STORE_DOWN_SECONDS,
                            extra={"error": f"{type(exc).__name__}: {exc}"})
                return
            retry_after = max(1, math.ceil(reset_at - time.time()))
            raise Problem("rate-limited", f"this token may submit {limit}; try again in {retry_after} s",
                          headers={"Retry-After": str(retry_after)}, retry_after=retry_after)
