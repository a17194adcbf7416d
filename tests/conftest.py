"""Shared fixtures (real Postgres and SQLite ledgers, a real S3 server: weed mini) and the ``slow`` rule.

``slow`` marks every test that compiles or starts processes: a cluster, a server, a private database or
broker, the S3 server, a compiler child or a CLI subprocess. ``pytest -m "not slow"`` is the quick loop
(under a minute); CI runs everything. The rule lives here, in one place: a test is slow when it uses one
of :data:`SLOW_FIXTURES` (directly or through another fixture), lives in one of :data:`SLOW_MODULES`, or
carries the marker itself (a parametrised fixture marks its S3 variant with ``pytest.param(..., marks=)``).
"""

from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.fixtures.ledger", "tests.fixtures.s3server", "tests.fixtures.checkpoints"]

#: Fixtures that start processes: clusters, servers, private services, the S3 server, CLI subprocesses.
SLOW_FIXTURES = frozenset({
    "make_cluster", "s3_server", "served", "private_postgres", "private_redis", "private_s3", "run",
    "tiny_torch_model", "scripted", "compose", "example_key", "error_runs", "fleet_api",
})
#: Modules whose every test runs a compiler child, a worker, a CLI or a server process.
SLOW_MODULES = (
    "tests/attacks/",
    "tests/faults/",
    "tests/soak/",
    "tests/workers/backends/test_cpu.py",
    "tests/workers/backends/test_neuron.py",
    "tests/workers/host/test_doctor.py",
    "tests/workers/test_e2e_api.py",
    "tests/workers/test_pipeline.py",
    "tests/workers/test_rollforward.py",
    "tests/workers/compiling/test_runner.py",
    "tests/workers/host/test_toolchain.py",
    "tests/web/server/test_server_errors.py",
    "tests/cli/test_dev.py",
    "tests/store/test_upload_sweep.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        uses = set(getattr(item, "fixturenames", ()))
        if uses & SLOW_FIXTURES or path.startswith(SLOW_MODULES):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    # ``item.report_call.failed`` lets a fixture's teardown see whether the test failed (and keep evidence).
    setattr(item, f"report_{report.when}", report)
    return report
