"""The broker loses its queue while builds are queued: every accepted build must still finish.

The incident (issue 6, item 1): with Redis restarted empty, or flushed, 8 of 12 accepted builds stayed
``queued`` for good. Their outbox rows were marked sent, the reaper only looked at running compiles with
expired leases, and resubmitting the same spec joined the stuck build.

Here both workers (one compile slot each) are kept busy by slow compiles while 12 more builds are
accepted, so the 12 messages are in Redis and nowhere else when it loses them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.faults.conftest import FaultCluster, summary, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]

QUEUED = 12
#: Long enough to accept 12 builds and break Redis while both workers are still busy.
BUSY_SECONDS = 10
#: From the fault to 14 terminal builds: the busy compiles' rest, then 12 quick compiles on 2 slots.
RECOVERY_SECONDS = 60


def _lose_queued_builds(faults: FaultCluster, fault: Callable[[], None]) -> None:
    faults.start_workers(2, concurrency=1)
    busy = [faults.api.submit(faults.hlo_spec(f"slow:{BUSY_SECONDS}", seq_lens=(8 * (i + 1),)))["build_id"]
            for i in range(2)]

    def both_running() -> bool:
        builds = [faults.api.build(build_id) for build_id in busy]
        return all(b is not None and b["buckets"][0]["state"] == "running" for b in builds)

    wait_for(both_running, 30, "both workers to be busy", interval=0.2)

    queued = [faults.api.submit(faults.hlo_spec("ok", seq_lens=(16 * (i + 1),)))["build_id"] for i in range(QUEUED)]
    wait_for(lambda: faults.broker_depth() == QUEUED, 20, f"{QUEUED} compile messages in Redis", interval=0.1)
    assert both_running(), "a busy compile finished before the fault: raise BUSY_SECONDS"

    fault()

    builds = faults.api.wait_builds(busy + queued, timeout=BUSY_SECONDS + RECOVERY_SECONDS)
    assert [b["state"] for b in builds] == ["succeeded"] * (2 + QUEUED), [summary(b) for b in builds]


def test_redis_flushed_with_queued_builds(faults: FaultCluster) -> None:
    _lose_queued_builds(faults, faults.redis.flushall)


def test_redis_restarted_empty_with_queued_builds(faults: FaultCluster) -> None:
    _lose_queued_builds(faults, faults.redis.restart)
