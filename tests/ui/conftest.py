"""The browser suite's fixtures: one real service per test process (:mod:`tests.ui.stack`), seeded with real
builds, and Chromium driven by Playwright. Screenshots of every step go to
``$COMPILESVC_TEST_ARTIFACTS/ui`` (default ``.test-artifacts/ui`` in the repository).

Every page runs under the service's Content-Security-Policy (web/server/security_headers.py), and a test during
which the browser reported a violation fails: the pages must work under the policy, not merely load."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ui.stack import CHROMIUM_ARGS, UiStack, find_chromium, running_stack, seed

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("COMPILESVC_TEST_ARTIFACTS", REPO / ".test-artifacts")) / "ui"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiStack]:
    with running_stack(tmp_path_factory.mktemp("ui") / "data") as running:
        seed(running)
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium on this machine: install Debian's chromium (.ci/test-tools does, as root) or "
                    "set COMPILESVC_CHROMIUM to a Chromium binary")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is a dev dependency")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


#: Reports each violation on the console too, with what was blocked (Chromium's own console message says
#: "Refused to …", but not for every kind of violation). Injected by the browser, so the CSP does not apply.
_REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", function (event) {
  console.error("CSP violation: " + event.effectiveDirective + " blocked " + (event.blockedURI || "inline") +
                " on " + event.documentURI);
});
"""


def is_csp_violation(text: str) -> bool:
    return text.startswith("CSP violation:") or "Content Security Policy" in text


@pytest.fixture
def csp_violations() -> list[str]:
    """Every CSP violation the test's pages reported (the ``page`` fixture fails the test on any)."""
    return []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that passed with CSP violations recorded fails (as a failure of the test, not of teardown)."""
    outcome = yield
    funcargs = getattr(item, "funcargs", {})
    if "page" in funcargs and not funcargs["page"].is_closed():
        funcargs["page"].wait_for_timeout(100)  # lets the console events of the last page arrive
    violations = funcargs.get("csp_violations")
    if violations and outcome.excinfo is None:
        outcome.force_exception(pytest.fail.Exception(
            "the pages broke their Content-Security-Policy:\n" + "\n".join(violations), pytrace=False))


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, csp_violations: list[str]) -> Iterator[Any]:
    """A fresh browser context (no cookies) at a laptop's screen size; its last screen is kept on failure."""
    context = browser.new_context(viewport={"width": 1366, "height": 768}, accept_downloads=True)
    context.add_init_script(_REPORT_VIOLATIONS)
    opened = context.new_page()
    opened.on("console", lambda message: csp_violations.append(message.text)
              if is_csp_violation(message.text) else None)
    opened.set_default_timeout(30_000)
    yield opened
    if getattr(request.node, "report_call", None) is not None and request.node.report_call.failed:
        shoot(opened, f"FAILED-{request.node.name}")
    context.close()


def shoot(page: Any, name: str) -> Path:
    """The whole page as ``ARTIFACTS/<name>.png`` (``name`` may name a subdirectory)."""
    path = ARTIFACTS / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path
