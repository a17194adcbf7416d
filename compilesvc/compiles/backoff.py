"""Retry delays: exponential, jittered, bounded. One rule for every infrastructure retry (a requeued
attempt, a publish the store refused, a claim the ledger did not take), so that a fleet of workers hit by
one outage does not come back in lockstep."""

from __future__ import annotations

import random

from compilesvc.config.settings import Settings


def delay(retry: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``retry`` (1 = the first).

    "Equal jitter": half of the exponential step is kept, half is random, so a retry never comes
    immediately and retries spread out (as in AWS's "Exponential Backoff And Jitter").
    """
    if retry < 1 or base <= 0:
        return 0.0
    step = min(cap, base * 2.0 ** min(retry - 1, 62))
    jitter: float = (rng or random).uniform(0, step / 2)
    return step / 2 + jitter


def for_settings(settings: Settings, retry: int) -> float:
    return delay(retry, settings.retry_backoff_seconds, settings.retry_backoff_max_seconds)
