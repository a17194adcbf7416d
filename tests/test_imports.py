"""Every module of the core imports on its own, first, in a fresh interpreter: an import cycle that
the order of a whole test run (or of a process's start) happens to hide still breaks whoever imports the
other end first. Found when ``pytest tests/cli/test_dev.py`` alone failed to collect (compilesvc.lifecycle.artifacts
-> events -> campaigns -> retention -> artifacts). The core only: web and workers import it, and re-importing
them module by module (workers' backends bring torch) costs CI several times as long."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compilesvc",)

# One interpreter, each module imported after every module of ours is forgotten: third-party libraries stay
# loaded (fast), our modules start from nothing each time. Prints the modules that fail, one per line.
PROBE = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {packages!r}]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""


def modules() -> list[str]:
    found = []
    for package in PACKAGES:
        found.append(package)
        for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            if not info.name.endswith("__main__"):
                found.append(info.name)
    return found


@pytest.mark.slow
def test_every_module_imports_first() -> None:
    names = modules()
    assert len(names) > 50
    result = subprocess.run([sys.executable, "-c", PROBE.format(packages=set(PACKAGES)), *names], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"modules that fail to import first:\n{result.stdout}"
