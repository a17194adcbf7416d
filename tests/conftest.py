"""Shared fixtures: real Postgres and SQLite ledgers, a real S3 server (weed mini)."""

from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.fixtures.ledger", "tests.fixtures.s3server"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    # ``item.report_call.failed`` lets a fixture's teardown see whether the test failed (and keep evidence).
    setattr(item, f"report_{report.when}", report)
    return report
