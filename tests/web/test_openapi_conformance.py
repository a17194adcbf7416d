"""The server against its own OpenAPI document, as every kind of caller (no token, then each scope), by
schemathesis with every check it has (:mod:`tests.web.conformance`): zero 5xx, zero answers the document
does not describe, the 401s and 403s of the scopes an operation refuses included.

The run is bounded to fit CI: ``EXAMPLES`` cases per operation and mode in all, split across the scopes
(:meth:`tests.web.conformance.Fuzzer.split`), so it costs what the admin-only run before it did. The long
run is ``python -m bench.fuzz`` (issue 12).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from schemathesis.generation import GenerationMode

from tests.web.conformance import APP_CONFIG, MODES, SCOPES, Fuzzer

#: Cases per operation and mode, all scopes together; COMPILESVC_FUZZ_EXAMPLES runs longer.
EXAMPLES = int(os.environ.get("COMPILESVC_FUZZ_EXAMPLES", "40"))

pytestmark = pytest.mark.slow  # hundreds of requests per mode: seconds, not the edit loop's milliseconds


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("scope", SCOPES)
def test_the_server_does_what_its_openapi_document_says(make_env: Any, sqlite_url: str, scope: str,
                                                       mode: GenerationMode) -> None:
    fuzzer = Fuzzer(make_env(sqlite_url, config=APP_CONFIG))
    tally = fuzzer.run(scope, mode, fuzzer.split(EXAMPLES))
    assert tally.cases > 0
    assert not tally.failures, "\n\n".join(found.describe() for found in tally.failures)
    assert tally.server_errors == 0, tally.statuses
