"""The ledger's Postgres restarted between two builds: the next compile must not be stranded.

The incident (issue 6, item 2): after ``pg_ctl restart``, a worker's pooled connections are dead; the
first compile dispatched to it failed its claim, Celery acked the failed task, and the bucket stayed
``queued`` for good. From Postgres back, the test times /readyz answering 200 again, the next submit being
accepted and its build finishing (:mod:`tests.faults.recovery`).
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import FaultCluster, summary
from tests.faults.recovery import Recovery, ready

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_postgres_restarted_between_builds(faults: FaultCluster) -> None:
    faults.start_workers(2, concurrency=1)

    # Two buckets that overlap (slow:1), so that each worker runs one and holds a pooled ledger connection.
    first = faults.api.submit(faults.hlo_spec("slow:1", seq_lens=(16, 32)))
    (built,) = faults.api.wait_builds([first["build_id"]], timeout=60)
    assert built["state"] == "succeeded", summary(built)
    assert len({b["worker_id"] for b in built["buckets"]}) == 2, built["buckets"]

    faults.postgres.restart("fast")  # every connection of every process is cut

    with Recovery("Postgres restarted between builds", faults.cluster, "Postgres back") as recovery:
        readiness = recovery.bounds.readiness
        recovery.watch("/readyz 200", lambda: ready(faults.api.base), readiness)
        recovery.watch("next submit accepted", bound=(readiness[0], f"as /readyz: {readiness[1]}"))
        compile_bound, why = recovery.bounds.claim_and_compile
        recovery.watch("next build succeeded", bound=(readiness[0] + compile_bound, f"as the submit + {why}"))
        recovery.healed()
        # A CI client retries 503 + Retry-After; the API may answer that once while its pool reconnects.
        second = faults.api.submit(faults.hlo_spec("ok", seq_lens=(48, 64)), retry_for=60)
        recovery.reached("next submit accepted")
        (built,) = faults.api.wait_builds([second["build_id"]], timeout=60)
        assert built["state"] == "succeeded", summary(built)
        assert all(b["attempts"] >= 1 for b in built["buckets"]), summary(built)
        recovery.reached("next build succeeded", built["finished_at"])
        recovery.record()
