"""requirements/server.lock: complete, hashed, inside pyproject's ranges, and what the Makefile (so CI) and the
images install. Read as text; no pip, no Docker engine, no network."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "server.lock"
MAKEFILE = ROOT / "Makefile"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERFILE_NEURON = ROOT / "docker" / "Dockerfile.neuron"
CI_RUN = ROOT / ".ci" / "run"
#: The platform the lock is made for (its header and docker/Dockerfile's python:3.11-slim say so).
LOCK_ENVIRONMENT = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
                    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                    "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _entries() -> dict[str, tuple[Version, list[str]]]:
    """{canonical name: (pinned version, hashes)}, one entry per requirement with its continuation lines."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    text = LOCK.read_text()
    for block in re.split(r"\n(?=[^\s#])", text):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
        if not lines:
            continue
        first = lines[0].rstrip(" \\")
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", first)
        assert match, f"not an exact pin: {first!r}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})\b", "\n".join(lines[1:]))
        assert len(hashes) == sum("--hash=" in line for line in lines), f"a malformed hash under {first!r}"
        entries[canonicalize_name(match.group(1))] = (Version(match.group(2)), hashes)
    return entries


def _server_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["server"] + extras["cpu"]]


def _make_rule(target: str) -> tuple[str, list[str]]:
    """The prerequisites and the recipe lines of one rule of the Makefile."""
    text = MAKEFILE.read_text()
    match = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n?)*)", text, re.MULTILINE)
    assert match, f"the Makefile has no rule for {target}"
    return match.group(1), [line.strip() for line in match.group(2).splitlines()]


def test_every_requirement_of_the_lock_is_pinned_and_hashed() -> None:
    entries = _entries()
    assert len(entries) > 40  # the whole server set, transitive dependencies included
    unhashed = sorted(name for name, (_, hashes) in entries.items() if not hashes)
    assert not unhashed, f"no hash for {unhashed}"
    # --allow-unsafe: torch needs setuptools, and --require-hashes refuses any dependency the file lacks.
    assert "setuptools" in entries


def test_the_lock_covers_every_server_range_inside_it() -> None:
    entries = _entries()
    for requirement in _server_requirements():
        if requirement.marker is not None and not requirement.marker.evaluate(LOCK_ENVIRONMENT):
            continue
        name = canonicalize_name(requirement.name)
        assert name in entries, f"the lock lacks {requirement}"
        version = entries[name][0]
        # prereleases=True: pyproject's ranges never admit a prerelease the lock could hold by accident, and a
        # local label (+cpu) is what the specifier's ``==2.13.0`` admits by PEP 440 anyway.
        assert requirement.specifier.contains(version, prereleases=True), f"{name}=={version} outside {requirement}"
    # The extras' own packages (psycopg[binary], celery[redis]) are locked too.
    assert {"psycopg-binary", "redis"} <= entries.keys()


def test_torch_is_the_cpu_build_with_the_cpu_index_hash() -> None:
    version, hashes = _entries()["torch"]
    assert str(version) == "2.13.0+cpu"
    # The manylinux_2_28_x86_64 cp311 wheel of https://download.pytorch.org/whl/cpu (docs/deploy.md#dependencies).
    assert hashes == ["6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"]
    docker = DOCKERFILE.read_text()
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(version.public)}$", docker, re.MULTILINE)


def test_the_lock_says_how_to_regenerate_it() -> None:
    head = LOCK.read_text().split("\n\n")[0][:3000]
    assert "#    make lock" in head and "Linux x86_64 and CPython 3.11" in head
    _, recipe = _make_rule("lock")
    compile_line = " ".join(line.rstrip("\\").strip() for line in recipe)
    for flag in ("--generate-hashes", "--allow-unsafe", "--extra server", "--extra cpu", "--no-emit-index-url",
                 "--output-file $(LOCK)"):
        assert flag in compile_line, flag


def test_make_install_installs_the_lock_with_hashes_then_dev_then_the_project() -> None:
    assert re.search(r"^LOCK := requirements/server\.lock$", MAKEFILE.read_text(), re.MULTILINE)
    prerequisites, recipe = _make_rule("$(BIN)/compilesvc")
    # The stamp is remade when the lock changes, not only pyproject.toml.
    assert prerequisites.split() == ["pyproject.toml", "$(LOCK)"]
    pip = [line for line in recipe if line.startswith("$(BIN)/pip install")]
    dev = "-c $(VENV)/lock-constraints.txt -r $(VENV)/dev-requirements.txt"
    steps = [
        next(i for i, line in enumerate(pip) if "--require-hashes -r $(LOCK)" in line),
        next(i for i, line in enumerate(pip) if dev in line),
        next(i for i, line in enumerate(pip) if "--no-deps -e ." in line),
    ]
    assert steps == sorted(steps), "lock, then dev constrained by it, then the project"
    # The constraints are the lock's pins, hashes dropped (pip would demand hashes of the dev tools too).
    assert any(line.startswith("sed ") and line.endswith("$(LOCK) > $(VENV)/lock-constraints.txt") for line in recipe)
    assert not any(re.search(r"-e '?\.\[", line) for line in pip), "an install that resolves the server set anew"
    # make dev and make test both go through that venv.
    assert "install" in _make_rule("dev")[0].split() and "install" in _make_rule("test")[0].split()


def test_the_cpu_image_installs_the_same_lock_with_hashes() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^COPY requirements/server\.lock (\S+)$", text, re.MULTILINE)
    installs = re.findall(r"pip install ([^\n]*)", text)
    locked = [line for line in installs if "-r /tmp/build/server.lock" in line]
    assert locked and "--require-hashes" in locked[0]
    # Nothing else resolves dependencies: the project itself comes with --no-deps.
    assert all(line in locked or line.startswith("--no-deps ") for line in installs), installs
    assert "!requirements/server.lock" in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()


def test_the_neuron_image_takes_the_lock_as_constraints() -> None:
    text = DOCKERFILE_NEURON.read_text()
    assert "requirements/server.lock /src/" in text and "-c /tmp/lock-constraints.txt" in text
    assert "--hash" not in text  # pins only: a hash in a constraints file would demand one of every package
    assert "!requirements/server.lock" in (ROOT / "docker" / "Dockerfile.neuron.dockerignore").read_text().split()


def test_the_upstream_check_is_not_part_of_ci() -> None:
    assert "test-upstream" not in CI_RUN.read_text()
    assert "test-upstream" not in " ".join(_make_rule("test")[1])
