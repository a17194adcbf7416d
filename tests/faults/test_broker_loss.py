"""The broker loses its queue while builds are queued: every accepted build must still finish.

The incident (issue 6, item 1): with Redis restarted empty, or flushed, 8 of 12 accepted builds stayed
``queued`` for good. Their outbox rows were marked sent, the reaper only looked at running compiles with
expired leases, and resubmitting the same spec joined the stuck build.

Here both workers (one compile slot each) are kept busy by slow compiles while more builds are accepted
(:data:`SCALE` ``.queued_builds``: 4 in CI, the incident's 12 in the bench), so their messages are in Redis
and nowhere else when it loses them. From the fault, each test times the API seeing the broker again (its metric), the
reconciler re-sending every lost compile and every build finishing (:mod:`tests.faults.recovery`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.faults.conftest import ApiClient, FaultCluster, summary, wait_for
from tests.faults.recovery import Recovery, dependency_up, epoch
from tests.faults.scale import SCALE

pytestmark = [pytest.mark.slow, pytest.mark.faults]

QUEUED = SCALE.queued_builds
#: Long enough to accept the queued builds and break Redis while both workers are still busy.
BUSY_SECONDS = SCALE.busy_seconds
#: From the fault to every build terminal: the busy compiles' rest, then the quick compiles on 2 slots.
RECOVERY_SECONDS = 60


def _lose_queued_builds(faults: FaultCluster, fault: Callable[[], None], what: str, healed: str, *,
                        broker_down: bool) -> None:
    faults.start_workers(2, concurrency=1)
    busy = [faults.api.submit(faults.hlo_spec(f"slow:{BUSY_SECONDS}", seq_lens=(8 * (i + 1),)))["build_id"]
            for i in range(2)]

    def both_running() -> bool:
        builds = [faults.api.build(build_id) for build_id in busy]
        return all(b is not None and b["buckets"][0]["state"] == "running" for b in builds)

    wait_for(both_running, 30, "both workers to be busy", interval=0.2)

    queued = [faults.api.submit(faults.hlo_spec("ok", seq_lens=(16 * (i + 1),)))["build_id"] for i in range(QUEUED)]
    wait_for(lambda: faults.broker_depth() == QUEUED, 20, f"{QUEUED} compile messages in Redis", interval=0.1)
    assert both_running(), "a busy compile finished before the fault: raise busy_seconds in tests/faults/scale.py"

    fault()

    with Recovery(f"{what} with {QUEUED} builds queued", faults.cluster, healed) as recovery:
        probe = ApiClient(faults.api.base)  # the poller's own session: requests.Session is not thread-safe

        def every_lost_compile_resent() -> float | None:
            """When the last lost compile was re-sent (its DISPATCH_LOST error's time), once all were."""
            resent = []
            for build_id in queued:
                build = probe.build(build_id)
                marks = [epoch(e["at"]) for e in build["buckets"][0]["errors"] if e["code"] == "DISPATCH_LOST"] \
                    if build is not None else []
                if not marks:
                    return None
                resent.append(min(marks))
            return max(resent)

        if broker_down:  # a flush leaves Redis up: nothing to come back
            recovery.watch("broker up (metrics)", lambda: dependency_up(faults.api.base, "broker"),
                           recovery.bounds.dependency_up)
        recovery.watch(f"all {QUEUED} lost compiles re-sent", every_lost_compile_resent, recovery.bounds.resend)
        recovery.watch(f"all {2 + QUEUED} builds succeeded", bound=(None, (
            f"no target: the busy compiles' rest (up to {BUSY_SECONDS} s), then {QUEUED} quick compiles on 2 "
            "slots")))
        recovery.healed()
        builds = faults.api.wait_builds(busy + queued, timeout=BUSY_SECONDS + RECOVERY_SECONDS)
        assert [b["state"] for b in builds] == ["succeeded"] * (2 + QUEUED), [summary(b) for b in builds]
        recovery.reached(f"all {2 + QUEUED} builds succeeded", max(epoch(b["finished_at"]) for b in builds))
        recovery.record()


def test_redis_flushed_with_queued_builds(faults: FaultCluster) -> None:
    _lose_queued_builds(faults, faults.redis.flushall, "Redis flushed", "the flush", broker_down=False)


def test_redis_restarted_empty_with_queued_builds(faults: FaultCluster) -> None:
    _lose_queued_builds(faults, faults.redis.restart, "Redis restarted empty", "Redis back (empty)",
                        broker_down=True)
