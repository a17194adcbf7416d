"""The README's screenshots, made anew: ``make screenshots`` (``python -m tests.ui.screenshots --out DIR``).

Runs the same real service and builds as the browser suite (:mod:`tests.ui.stack`), signs in with
Chromium and saves ``history.png`` (the build list) and ``build-miss.png`` (a build whose key missed, with
the flag that made it compile) into ``DIR`` (default ``docs/screenshots``). Needs Chromium
(``.ci/test-tools`` installs it) and takes about a minute.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.ui.stack import CHROMIUM_ARGS, find_chromium, running_stack, seed

VIEWPORT = {"width": 1280, "height": 800}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("screenshots: no Chromium (install Debian's chromium, or set COMPILESVC_CHROMIUM)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compilesvc-screenshots-") as tmp, \
            running_stack(Path(tmp) / "data") as stack, sync_playwright() as playwright:
        builds = seed(stack)
        stack.wait(builds["joined_failure"])
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
        page.goto(stack.base + "/login")
        page.get_by_label("Token").fill(stack.token)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(stack.base + "/")
        page.screenshot(path=str(args.out / "history.png"))
        page.goto(f"{stack.base}/builds/{builds['miss']}")
        page.locator("#log-status", has_text="build succeeded").wait_for()
        # From the top of the page to the end of the miss explanation: what the README shows.
        bottom = page.evaluate("document.getElementById('key-changes').getBoundingClientRect().bottom + 16")
        page.set_viewport_size({"width": VIEWPORT["width"], "height": int(bottom)})
        page.screenshot(path=str(args.out / "build-miss.png"))
        browser.close()
    for name in ("history.png", "build-miss.png"):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
