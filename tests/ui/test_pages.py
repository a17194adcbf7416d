"""Every page of the UI at a laptop's screen (1366 by 768) and a phone's (390 by 844), checked by axe-core (the
accessibility engine, from ``.ci/node``; no serious or critical violation) and for what a small screen
breaks: nothing scrolls sideways (wide tables scroll inside their own box), the header wraps rather than
hides a link, and the Stats charts' axis labels are inside their charts (issue 27, finding 7). A
screenshot of each page at each size goes to the test artifacts directory, ``.test-artifacts/ui/pages/``
(tests/ui/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.ui.conftest import shoot
from tests.ui.stack import UiStack
from tests.ui.test_browser import sign_in
from tests.web.node_tools import node_tool

pytestmark = pytest.mark.slow

AXE = "axe-core/axe.min.js"  # under .ci/node/node_modules
VIEWPORTS = {"laptop": {"width": 1366, "height": 768}, "phone": {"width": 390, "height": 844}}


def pages(stack: UiStack) -> dict[str, str]:
    """Every kind of page, by name: the seeded builds show every part of the build page."""
    builds = {f"build-{name}": f"/builds/{build_id}" for name, build_id in stack.builds.items()}
    return {"history": "/", "history-filtered": "/?label=team%3Asearch", **builds, "artifacts": "/artifacts",
            "workers": "/workers", "campaigns": "/campaigns", "stats-day": "/stats", "stats-week": "/stats?window=week",
            "api-docs": "/docs",
            "not-found": "/builds/999999"}


#: What a small screen breaks, measured in the page: sideways scrolling, header links out of the screen
#: or hidden, chart labels outside their chart (an SVG clips what is outside its box); and unnamed <nav>
#: landmarks (axe-core counts two of them a moderate finding only).
_LAYOUT = """() => {
  const found = [];
  const width = window.innerWidth;
  if (document.documentElement.scrollWidth > width) {
    found.push(`the page is ${document.documentElement.scrollWidth} px wide on a ${width} px screen`);
  }
  for (const el of document.querySelectorAll("header a, header button, header .who")) {
    const r = el.getBoundingClientRect();
    const shown = r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== "hidden";
    if (!shown || r.left < 0 || r.right > width + 0.5) {
      found.push(`header "${el.textContent.trim()}" is ${shown ? "at " + r.left + " to " + r.right : "hidden"}`);
    }
  }
  for (const nav of document.querySelectorAll("nav")) {  // a screen reader lists landmarks by their names
    if (!nav.getAttribute("aria-label") && !nav.getAttribute("aria-labelledby")) {
      found.push(`a <nav> without a name: ${nav.outerHTML.slice(0, 60)}`);
    }
  }
  for (const svg of document.querySelectorAll("figure.chart svg[viewBox]")) {
    const box = svg.getBoundingClientRect();
    for (const text of svg.querySelectorAll("text")) {
      const r = text.getBoundingClientRect();
      const inside = r.left >= box.left - 0.5 && r.right <= box.right + 0.5 && r.top >= box.top - 0.5 &&
                     r.bottom <= box.bottom + 0.5;
      if (!inside) {
        found.push(`chart label "${text.textContent}" is cut off (${r.right} past ${box.right})`);
      }
    }
  }
  return found;
}"""


@pytest.fixture
def axe_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A page whose context lets axe-core in: add_script_tag inserts an inline script, which the service's
    CSP refuses (rightly: every other test runs under it)."""
    node_tool(AXE)  # skips, saying how to install it, when it is not there
    context = browser.new_context(viewport=VIEWPORTS[request.param], bypass_csp=True)
    opened = context.new_page()
    opened.set_default_timeout(30_000)
    yield opened
    context.close()


def serious_violations(page: Any) -> list[str]:
    """axe-core's serious and critical findings on the page as it is now, a line each."""
    page.add_script_tag(path=str(node_tool(AXE)))
    result = page.evaluate("async () => (await axe.run(document, {resultTypes: ['violations']})).violations")
    return [f"{v['id']} ({v['impact']}): {v['help']}; " +
            "; ".join(f"{' '.join(n['target'])}: {n['failureSummary'].splitlines()[-1].strip()}"
                      for n in v["nodes"][:4]) + (f" … and {len(v['nodes']) - 4} more" if len(v["nodes"]) > 4 else "")
            for v in result if v["impact"] in ("serious", "critical")]


@pytest.mark.parametrize("axe_page", list(VIEWPORTS), indirect=True)
def test_every_page_is_accessible_and_fits_the_screen(axe_page: Any, stack: UiStack) -> None:
    page = axe_page
    size = f"{page.viewport_size['width']}x{page.viewport_size['height']}"
    problems: list[str] = []
    page.goto(stack.base + "/login")
    problems += [f"login: {p}" for p in serious_violations(page) + page.evaluate(_LAYOUT)]
    shoot(page, f"pages/{size}/login")
    sign_in(page, stack, path="/")
    for name, path in pages(stack).items():
        page.goto(stack.base + path)
        if page.locator("#log-status").count():
            page.locator("#log-status", has_text="build").or_(page.locator("#log-status", has_text="streaming")) \
                .first.wait_for()
        problems += [f"{name}: {p}" for p in serious_violations(page) + page.evaluate(_LAYOUT)]
        shoot(page, f"pages/{size}/{name}")
    assert not problems, f"at {size}:\n" + "\n".join(problems)


def test_a_build_reads_the_same_about_the_cache_on_its_page_and_in_the_history(page: Any, stack: UiStack) -> None:
    sign_in(page, stack)
    for name, build_id in stack.builds.items():
        listed = page.locator(f"#build-{build_id} td[class*='cache-']").inner_text().strip()
        page.goto(f"{stack.base}/builds/{build_id}")
        assert cache_line(page) == listed, name
        page.go_back()
    page.goto(f"{stack.base}/builds/{stack.builds['partly']}")
    assert cache_line(page) == "partly reused (3 of 4)"


def cache_line(page: Any) -> str:
    """What the build page's summary says under Cache."""
    return str(page.locator("section.summary dt", has_text="Cache").locator("xpath=following-sibling::dd[1]")
               .inner_text()).strip()
