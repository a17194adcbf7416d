"""The server against its own OpenAPI document, as every kind of caller (no token, then each scope), by
schemathesis with every check it has (:mod:`tests.web.conformance`): zero 5xx, zero answers the document
does not describe, the 401s and 403s of the scopes an operation refuses included.

The run is bounded to fit CI: ``EXAMPLES`` cases per operation and mode in all, split across the scopes
(:meth:`tests.web.conformance.Fuzzer.split`), so it costs no more than the admin-only run before it did. The scopes
share one environment (built once: the fixed cost of ten would be a fifth of the run's); what one scope's
cases make (builds, pins, tokens), the next one's find. The long run is ``python -m bench.fuzz`` (issue 12).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from schemathesis.generation import GenerationMode

from tests.web.conformance import MODES, SCOPES, Fuzzer, close_env, fuzz_env

#: Cases per operation and mode, all scopes together; COMPILESVC_FUZZ_EXAMPLES runs longer. 36, not the 40
#: of the admin-only run before: each scope's run of an operation has a fixed cost of its own (hypothesis
#: starts once per operation, scope and mode), which the 4 cases make up for.
EXAMPLES = int(os.environ.get("COMPILESVC_FUZZ_EXAMPLES", "36"))

pytestmark = pytest.mark.slow  # hundreds of requests per mode: seconds, not the edit loop's milliseconds


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> Iterator[Fuzzer]:
    workdir = tmp_path_factory.mktemp("conformance")
    shutil.copyfile(sqlite_template, workdir / "ledger.db")
    env = fuzz_env(workdir, f"sqlite:///{workdir / 'ledger.db'}")
    try:
        yield Fuzzer(env)
    finally:
        close_env(env)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("scope", SCOPES)
def test_the_server_does_what_its_openapi_document_says(fuzzer: Fuzzer, scope: str, mode: GenerationMode) -> None:
    tally = fuzzer.run(scope, mode, fuzzer.split(EXAMPLES))
    assert tally.cases > 0
    # The scope's token is the one sent: only a caller without one is asked for one (401), and every scope
    # short of admin is refused something (403).
    assert (401 in tally.statuses) == (scope == "none"), tally.statuses
    assert scope in ("none", "admin") or 403 in tally.statuses, tally.statuses
    assert not tally.failures, "\n\n".join(found.describe() for found in tally.failures)
    assert tally.server_errors == 0, tally.statuses
