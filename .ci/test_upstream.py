#!/usr/bin/env python3
"""`make test-upstream`: the fault suite against the newest PyPI release of each broker, ledger and store client,
one upgraded package at a time over requirements/server.lock, and a table of which upgrade broke what.

Not part of `.ci/run` (an upstream release must never block a landing): run it before `make lock
LOCK_ARGS="--upgrade-package NAME"`, or when an upstream release is suspected (issue 37: celery 5.7.0 / kombu
5.7.0 / redis-py 8.1.0 stopped consuming after a Redis restart).

    python3 .ci/test_upstream.py                       # every package below, then the table
    python3 .ci/test_upstream.py --packages celery,redis --base .venv
    python3 .ci/test_upstream.py --dry-run             # the plan only: no venv, no network, no test
    python3 .ci/test_upstream.py --packages kombu -- -k broker   # after --: more pytest arguments

How: one base venv from the lock, installed as `make install` does (the lock with --require-hashes, the `dev`
extra constrained by it, the project --no-deps); then for each package a venv of its own layered over the base
(a .pth file adds the base's site-packages after its own), into which pip installs the newest release of that
one package and only what that release requires anew. The base is never touched, so every row differs from
the lock by one upgrade, and no row costs a full install. The first row runs the lock alone, so a failure in
an upgrade's row can be told from one the lock already has. Standard library only: it runs before any venv.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "server.lock"
#: The broker's client stack first (issue 37), then the ledger's, then the store's.
DEFAULT_PACKAGES = ("celery", "kombu", "redis", "sqlalchemy", "psycopg", "boto3")
PYTEST_ARGS = ("-m", "faults", "tests/faults", "-p", "no:cacheprovider", "-q")


@dataclass
class Step:
    """One command of the plan, with what it is for."""

    why: str
    argv: list[str]


@dataclass
class Row:
    """One line of the table: an upgrade (or the lock alone) and what the fault suite said."""

    package: str
    locked: str = ""
    newest: str = ""
    moved: list[str] = field(default_factory=list)
    result: str = "not run"
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test-upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), type=_package_list,
                        help="comma-separated packages of the lock to upgrade, one at a time "
                             f"(default: {','.join(DEFAULT_PACKAGES)})")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument("--base", type=Path,
                        help="an existing venv with the lock installed (e.g. .venv after `make install`) "
                             "instead of building one; it is only read")
    parser.add_argument("--no-baseline", action="store_true", help="skip the row of the lock alone")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (venvs, logs, junit files)")
    parser.add_argument("--python", default=sys.executable, help="the Python of the venvs (3.11, as the lock's)")
    parser.add_argument("pytest_args", nargs="*",
                        help=f"after --: more arguments for pytest (always: {' '.join(PYTEST_ARGS)})")
    args = parser.parse_args(argv)
    locked = locked_versions()
    unknown = [name for name in args.packages if name not in locked]
    if unknown:
        parser.error(f"not in {LOCK.relative_to(ROOT)}: {', '.join(unknown)}")
    if args.base is not None and not (args.base / "bin" / "python").exists():
        parser.error(f"--base {args.base}: no bin/python there")
    return args


def _package_list(value: str) -> list[str]:
    names = [_canonical(name) for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no package named")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a package named twice: {value}")
    return names


def _canonical(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", "-").replace(".", "-").split("-"))


def locked_versions(lock: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of the lock's pins."""
    pins: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if line[:1].isalnum() and "==" in line:
            name, _, version = line.split()[0].partition("==")
            pins[_canonical(name)] = version
    return pins


def dev_requirements() -> list[str]:
    """The `dev` extra of pyproject.toml, as `make install` installs it."""
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"])


def lock_constraints(lock: Path = LOCK) -> str:
    """The lock's pins without their hashes, for pip -c (a hashed constraint makes pip demand every hash)."""
    return "".join(f"{name}=={version}\n" for name, version in locked_versions(lock).items())


def base_steps(python: str, base: Path, dev_file: Path) -> list[Step]:
    """What `make install` does, into `base`."""
    pip = [str(base / "bin" / "python"), "-m", "pip", "install", "-q"]
    dev = dev_requirements()
    return [
        Step("the base venv", [python, "-m", "venv", str(base)]),
        Step("pip", [*pip, "--upgrade", "pip"]),
        Step("the lock, hash-checked", [*pip, "--require-hashes", "-r", str(LOCK)]),
        Step(f"the dev extra, constrained by the lock ({dev_file.name}: {len(dev)} requirements)",
             [*pip, "-c", str(dev_file.with_name("lock-constraints.txt")), "-r", str(dev_file)]),
        Step("the project", [*pip, "--no-deps", "-e", str(ROOT)]),
    ]


def layer_steps(python: str, base: Path, layer: Path, package: str) -> list[Step]:
    """A venv over `base` with the newest release of `package` (and only what it requires anew)."""
    pip = [str(layer / "bin" / "python"), "-m", "pip"]
    return [
        Step(f"a venv layered over the base for {package}", [python, "-m", "venv", str(layer)]),
        Step(f"the newest {package}, over the lock",
             [*pip, "install", "-q", "--upgrade", "--upgrade-strategy", "only-if-needed",
              "--report", str(layer / "report.json"), package]),
    ]


def pytest_step(venv: Path, junit: Path, pytest_args: list[str]) -> Step:
    return Step("the fault suite", [str(venv / "bin" / "python"), "-m", "pytest", *pytest_args,
                                    f"--junitxml={junit}"])


def plan(args: argparse.Namespace, workdir: Path) -> list[tuple[str, list[Step]]]:
    """Every command, grouped by the row it belongs to (the base's group has the name "")."""
    base = args.base or workdir / "base"
    pytest_args = [*PYTEST_ARGS, *args.pytest_args]
    groups: list[tuple[str, list[Step]]] = []
    if args.base is None:
        groups.append(("", base_steps(args.python, base, workdir / "dev-requirements.txt")))
    if not args.no_baseline:
        groups.append(("(lock)", [pytest_step(base, workdir / "lock.xml", pytest_args)]))
    for package in args.packages:
        layer = workdir / package
        groups.append((package, [*layer_steps(args.python, base, layer, package),
                                 pytest_step(layer, workdir / f"{package}.xml", pytest_args)]))
    return groups


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise RuntimeError(f"{venv}: no site-packages")
    return found[0]


def _run(step: Step, log: Path) -> int:
    print(f"  {step.why}: {' '.join(step.argv)}", flush=True)
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(step.argv)}\n")
        out.flush()
        return subprocess.run(step.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def _failures(junit: Path) -> list[str]:
    if not junit.exists():
        return ["(no junit report: pytest did not finish)"]
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}")
    return failed


def _moved(report: Path) -> dict[str, str]:
    """{name: version} of what pip installed in a layer (its --report)."""
    if not report.exists():
        return {}
    data = json.loads(report.read_text())
    return {_canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in data.get("install", [])}


def execute(args: argparse.Namespace, workdir: Path) -> list[Row]:
    locked = locked_versions()
    log = workdir / "test-upstream.log"
    (workdir / "dev-requirements.txt").write_text("\n".join(dev_requirements()) + "\n")
    (workdir / "lock-constraints.txt").write_text(lock_constraints())
    rows: list[Row] = []
    for name, steps in plan(args, workdir):
        print(f"== {name or 'base venv'} (log: {log})", flush=True)
        row = Row(package=name, locked=locked.get(name, ""))
        started = time.monotonic()
        for step in steps:
            if step.argv[1:3] == ["-m", "pytest"]:
                code = _run(step, log)
                junit = Path(step.argv[-1].partition("=")[2])
                row.failed = _failures(junit) if code else []
                row.result = "passed" if code == 0 else f"FAILED ({len(row.failed)})"
                continue
            code = _run(step, log)
            if step.argv[1:3] == ["-m", "venv"] and name:
                layer = Path(step.argv[-1])
                # Lines of a .pth that start with "import" run at start-up: addsitedir also runs the base's own
                # .pth files (the editable project), after the layer's site-packages.
                base = args.base or workdir / "base"
                (_site_packages(layer) / "zz_base.pth").write_text(
                    f"import site; site.addsitedir({str(_site_packages(base))!r})\n")
            if code != 0:
                if not name:
                    raise SystemExit(f"building the base venv failed: see {log}")
                row.result = f"upgrade failed (pip exit {code})"
                break
            if "--report" in step.argv:
                moved = _moved(Path(step.argv[step.argv.index("--report") + 1]))
                row.newest = moved.get(name, locked.get(name, ""))
                row.moved = [f"{n}=={v}" for n, v in sorted(moved.items()) if n != name]
                if name not in moved:
                    row.result = "newest is the lock's: not run"
                    break
        row.seconds = time.monotonic() - started
        if name:
            rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| upgrade | locked | newest | also moved | fault suite | failed tests | s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        cells = [row.package, row.locked or "-", row.newest or "-", ", ".join(row.moved) or "-", row.result,
                 "<br>".join(row.failed) or "-", f"{row.seconds:.0f}"]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        workdir = Path(tempfile.gettempdir()) / "compilesvc-upstream-XXXX"
        locked = locked_versions()
        print(f"plan (dry run; venvs would be under {workdir}):")
        for name, steps in plan(args, workdir):
            print(f"== {name or 'base venv'}" + (f" (locked {locked[name]})" if name in locked else ""))
            for step in steps:
                print(f"  {step.why}: {' '.join(step.argv)}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="compilesvc-upstream-"))
    try:
        rows = execute(args, workdir)
    finally:
        if not args.keep:
            # The log goes first to the table's reader: copy it out of the dir about to be removed.
            log = workdir / "test-upstream.log"
            if log.exists():
                shutil.copy(log, Path(tempfile.gettempdir()) / f"{workdir.name}.log")
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows))
    return 1 if any(row.result.startswith(("FAILED", "upgrade failed")) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
