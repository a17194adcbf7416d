"""The Node tools of the test suite (Spectral, axe-core), installed by ``.ci/test-tools`` with ``npm ci`` from
the committed ``.ci/node/package.json`` and ``package-lock.json`` into ``.ci/node/node_modules`` (gitignored).
A test that needs one skips, saying how to get it, when it is not there, as the Chromium tests do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NODE_MODULES = Path(__file__).resolve().parents[2] / ".ci" / "node" / "node_modules"


def node_tool(relative: str) -> Path:
    """``relative`` under ``.ci/node/node_modules`` (e.g. ``.bin/spectral``), or a skip saying how to install it."""
    path = NODE_MODULES / relative
    if shutil.which("node") is None or not path.exists():
        pytest.skip(f"no {path}: run .ci/test-tools (npm ci in .ci/node; needs node and npm) to install the "
                    "Node tools of the tests")
    return path
