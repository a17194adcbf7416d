"""Whether this host can load an artifact: the versions its manifest records against the host's own.

A Neuron artifact loaded by another torch-neuronx or runtime fails at load with opaque errors
(``status=2 message=Invalid``; ../shared/REFERENCE.md: "Runtime and compiler versions must match what
the artifact was built with"), and an AOTInductor library built for AVX-512 dies with SIGILL on an AVX2
host. The check compares what every bucket's manifest records:

* ``torch``: the same release (local build tags such as ``+cpu`` aside);
* ``torch_neuronx``, ``neuronx_distributed``: the same package version;
* ``aws_neuronx_runtime_lib``: the same runtime library version (a system package, read with dpkg-query
  or rpm; a host where neither can tell gets a warning, never a refusal on a guess);
* ``isa`` (cpu artifacts): a vector ISA this host's CPU runs.

Reading versions imports nothing: package metadata only, so serving code pays no torch import for it.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from importlib import metadata
from typing import Any

from compilesvc.fleet._remote import FleetError
from compilesvc.hostinfo import host_isa, isa_runs_on

RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"
#: Manifest version fields that are Python packages the serving process imports, by distribution name.
PACKAGES = {"torch": "torch", "torch_neuronx": "torch-neuronx", "neuronx_distributed": "neuronx-distributed"}


class HostCheck(StrEnum):
    """What :meth:`ArtifactSet.open` does when the host does not match (``COMPILESVC_HOST_CHECK``)."""

    REFUSE = "refuse"  # raise VersionMismatch (the default: a mismatch only fails later, and worse)
    WARN = "warn"  # a VersionMismatchWarning, then go on
    OFF = "off"


class VersionMismatch(FleetError):
    """This host cannot be trusted to load the artifact; ``mismatches`` says what differs."""

    def __init__(self, message: str, mismatches: list[str]):
        super().__init__(message)
        self.mismatches = mismatches


class VersionMismatchWarning(UserWarning):
    """The host does not match the artifact, and ``host_check="warn"`` let it load anyway."""


@dataclass
class HostReport:
    """The comparison: what differs (refuse or warn), and what this host could not tell (warn only)."""

    mismatches: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def package_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@cache
def runtime_lib_version() -> str | None:
    """The installed Neuron runtime library's version (``2.23.112.0``), or None when it cannot be read."""
    commands = (["dpkg-query", "-W", "-f=${Version}", RUNTIME_PACKAGE],
                ["rpm", "-q", "--qf", "%{VERSION}", RUNTIME_PACKAGE])
    for command in commands:
        if shutil.which(command[0]) is None:
            continue
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().split("-", 1)[0]  # dpkg's "2.23.112.0-9b5179492": the version part
    return None


def compare(recorded: Mapping[str, Any], *, packages: Mapping[str, str | None] | None = None,
            runtime: str | None = None, isa: str | None = None) -> HostReport:
    """``recorded`` (a bucket's manifest versions) against the host (the keyword arguments override what
    is read from this host, for a check made on another machine's behalf)."""
    report = HostReport()
    for field_name, distribution in PACKAGES.items():
        wanted = recorded.get(field_name)
        if not wanted:
            continue
        have = packages[distribution] if packages is not None and distribution in packages \
            else package_version(distribution)
        same = have is not None and (_public(have) == _public(str(wanted)) if field_name == "torch"
                                     else have == str(wanted))
        if not same:
            report.mismatches.append(f"{distribution}: built with {wanted}, this host has "
                                     f"{have or 'none installed'}")
    wanted_runtime = recorded.get("aws_neuronx_runtime_lib")
    if wanted_runtime:
        have_runtime = runtime if runtime is not None else runtime_lib_version()
        if have_runtime is None:
            report.unknown.append(f"{RUNTIME_PACKAGE}: built for {wanted_runtime}; this host's version cannot "
                                  "be read (no dpkg-query or rpm knows the package)")
        elif have_runtime != wanted_runtime:
            report.mismatches.append(f"{RUNTIME_PACKAGE}: built for {wanted_runtime}, this host has {have_runtime}")
    wanted_isa = recorded.get("isa")
    if wanted_isa:
        have_isa = isa or host_isa()
        if not isa_runs_on(str(wanted_isa), have_isa):
            report.mismatches.append(f"isa: built for {wanted_isa}, this host's CPU is {have_isa}")
    return report


def enforce(key: str, versions: Iterable[Mapping[str, Any]], policy: HostCheck) -> HostReport:
    """Compare every bucket's recorded versions; refuse, warn or ignore as ``policy`` says."""
    report = HostReport()
    if policy == HostCheck.OFF:
        return report
    for recorded in versions:
        one = compare(recorded)
        report.mismatches += [m for m in one.mismatches if m not in report.mismatches]
        report.unknown += [u for u in one.unknown if u not in report.unknown]
    for unknown in report.unknown:
        warnings.warn(f"artifact {key}: {unknown}", VersionMismatchWarning, stacklevel=3)
    if report.mismatches:
        text = (f"artifact {key} was built for another host: {'; '.join(report.mismatches)} (set "
                f"COMPILESVC_HOST_CHECK=warn to load it anyway)")
        if policy == HostCheck.REFUSE:
            raise VersionMismatch(text, report.mismatches)
        warnings.warn(text, VersionMismatchWarning, stacklevel=3)
    return report
