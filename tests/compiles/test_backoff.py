"""Retry delays: exponential, jittered, bounded."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from compilesvc.compiles import backoff


@given(st.integers(min_value=1, max_value=10_000), st.floats(min_value=0.01, max_value=100),
       st.floats(min_value=0.01, max_value=10_000), st.integers())
def test_a_delay_is_between_half_and_all_of_its_capped_exponential_step(retry: int, base: float, cap: float,
                                                                       seed: int) -> None:
    step = min(cap, base * 2.0 ** min(retry - 1, 62))
    assert step / 2 <= backoff.delay(retry, base, cap, random.Random(seed)) <= step


def test_delays_grow_then_stop_at_the_cap_and_spread_out() -> None:
    rng = random.Random(7)
    firsts = [backoff.delay(1, 4, 60, rng) for _ in range(200)]
    assert min(firsts) >= 2 and max(firsts) <= 4 and len({round(d, 3) for d in firsts}) > 150  # jittered
    assert all(30 <= backoff.delay(n, 4, 60, rng) <= 60 for n in range(5, 80))
    assert backoff.delay(1, 0, 60) == 0 == backoff.delay(0, 4, 60)
