"""The Neuron SDK release table: which exact packages each SDK release ships.

Owns ``compilesvc/neuron_releases.json`` (our format, generated from the SDK's own release manifest,
aws-neuron/aws-neuron-sdk ``src/helperscripts/n2-manifest.json``), the look-ups built on it, and the
conversion behind ``compilesvc neuron-releases refresh``. Package versions are not release numbers (SDK
2.27.1 ships neuronx-cc 2.22.12471.0, torch-neuronx 2.9.0.2.11.19912, …), and consecutive releases can ship
identical packages (2.27.0/2.27.1, 2.24.0/2.24.1). Two consumers need the exact versions:

- the key (:func:`compilesvc.spec.neuron_toolchain.toolchain_material`): a Neuron key names the toolchain a
  release resolves to, not the release label (docs/keys.md, "Toolchain");
- the worker: it checks that its installed packages are the release it claims before it registers
  (:func:`installed_mismatches`, used by :mod:`workers.host.capabilities`).

What a release can compile (kinds, targets, device needs) is :mod:`compilesvc.spec.neuron_kinds`; the key's
toolchain part :mod:`compilesvc.spec.neuron_toolchain`; the table's refresh from the SDK's manifest
:mod:`compilesvc.spec.neuron_releases_refresh`.

A release lists one torch-neuronx build per torch line (2.27.1: torch 2.7, 2.8 and 2.9). A trace artifact
depends on which one ran, so the key pins one: the release's newest torch line (:attr:`Release.trace_torch_neuronx`,
what the SDK's container images of that release ship); a worker with another line installed refuses to serve.

torch-xla is not in the table: the SDK's manifest lists it for a few releases only (1.12/1.13 and 2.10
onwards, checked 2026-11-24), and the torch-neuronx build the key pins is built against one torch line, whose
torch-xla it depends on (not verified against a wheel here: the SDK cannot be installed).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

TABLE_FORMAT = "compilesvc-neuron-releases/1"
TABLE_NAME = "neuron_releases.json"
REFRESH_COMMAND = "compilesvc neuron-releases refresh --from <n2-manifest.json path or URL>"
#: Where the SDK publishes the manifest the table is made from.
SDK_MANIFEST_URL = ("https://raw.githubusercontent.com/aws-neuron/aws-neuron-sdk/master/"
                    "src/helperscripts/n2-manifest.json")

#: Our package names -> the names the SDK manifest uses for them (it spells neuronx_distributed with "_").
PACKAGES = {
    "neuronx-cc": ("neuronx-cc",),
    "torch-neuronx": ("torch-neuronx",),
    "neuronx-distributed": ("neuronx_distributed", "neuronx-distributed"),
    # NxD Inference (NxDI): SDK 2.21.0 (0.1.0) through 2.31.1 (0.10.18399); 2.32.0 ships none
    # (docs/research/nxdi.md §0, from the manifest's "neuronx_distributed_inference" entries).
    "neuronx-distributed-inference": ("neuronx_distributed_inference", "neuronx-distributed-inference"),
    "libneuronxla": ("libneuronxla",),
    "aws-neuronx-runtime-lib": ("aws-neuronx-runtime-lib",),
}
#: Packages a release may list several builds of (one per torch line / per framework).
MULTI = frozenset({"torch-neuronx", "libneuronxla"})
#: The Neuron targets a spec may name (compilesvc.spec.compile_spec.NEURON_TARGETS): the instance families the
#: manifest can list for a release's neuronx-cc. trn1n is a trn1 to the service (one target, one queue).
TARGET_FAMILIES = ("inf2", "trn1", "trn2", "trn3")


class UnknownRelease(ValueError):
    """A Neuron SDK release the table does not list."""

    def __init__(self, release: str, known: list[str]):
        self.release = release
        newest = known[-1] if known else "none"
        super().__init__(f"Neuron SDK release {release} is not in this service's release table (newest known: "
                         f"{newest}); if it is a new release, refresh the table: {REFRESH_COMMAND}")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.9.0.2.11.19912+abc"`` -> ``(2, 9, 0, 2, 11, 19912)``: for ordering builds of one package."""
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("+")[0].split("."))


def base_version(version: str) -> str:
    """Without the ``+<build hash>`` local suffix pip and ``neuronx-cc --version`` print."""
    return version.strip().split("+")[0]


@dataclass(frozen=True)
class Release:
    """The exact packages of one SDK release (multi-build packages newest first)."""

    release: str
    neuronx_cc: str
    torch_neuronx: tuple[str, ...]
    neuronx_distributed: str | None
    libneuronxla: tuple[str, ...]
    runtime_lib: str | None  # aws-neuronx-runtime-lib, a system package: recorded, not checked
    #: The Neuron targets (:data:`TARGET_FAMILIES`) among the instance families the manifest lists for this
    #: release's neuronx-cc (``supported_instances``): trn2 from 2.21.0, trn3 from 2.29.0.
    targets: tuple[str, ...] = ()
    #: neuronx-distributed-inference (NxDI), which compiles hf-checkpoint models (backend nxdi).
    neuronx_distributed_inference: str | None = None

    @property
    def trace_torch_neuronx(self) -> str | None:
        """The torch-neuronx build trace compiles of this release are keyed with: its newest torch line."""
        return self.torch_neuronx[0] if self.torch_neuronx else None

    def as_versions(self) -> dict[str, Any]:
        """The release's packages as manifests record them (``neuron_release_packages``)."""
        return {"release": self.release, "neuronx-cc": self.neuronx_cc, "torch-neuronx": list(self.torch_neuronx),
                "neuronx-distributed": self.neuronx_distributed, "libneuronxla": list(self.libneuronxla),
                "neuronx-distributed-inference": self.neuronx_distributed_inference,
                "aws-neuronx-runtime-lib": self.runtime_lib}


def _release_of(label: str, entry: Mapping[str, Any]) -> Release:
    return Release(release=label, neuronx_cc=str(entry["neuronx-cc"]),
                   torch_neuronx=tuple(entry.get("torch-neuronx") or ()),
                   neuronx_distributed=entry.get("neuronx-distributed"),
                   libneuronxla=tuple(entry.get("libneuronxla") or ()),
                   runtime_lib=entry.get("aws-neuronx-runtime-lib"),
                   neuronx_distributed_inference=entry.get("neuronx-distributed-inference"),
                   targets=tuple(t for t in TARGET_FAMILIES if t in (entry.get("instances") or ())))


def table_path() -> Path:
    """The packaged table (the file ``refresh`` rewrites by default)."""
    return Path(str(resources.files("compilesvc.spec").joinpath(TABLE_NAME)))


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Release]:
    """Every release in the packaged table, oldest first."""
    document = json.loads(table_path().read_text(encoding="utf-8"))
    if document.get("format") != TABLE_FORMAT:
        raise RuntimeError(f"{table_path()} is not a {TABLE_FORMAT} document")
    releases = document["releases"]
    return {label: _release_of(label, releases[label]) for label in sorted(releases, key=version_tuple)}


@functools.lru_cache(maxsize=1)
def from_docs() -> dict[str, str]:
    """Releases whose entry was built from the SDK's release pages, not its manifest, with the citation.

    The manifest reachable here can lag the SDK's docs (2.33.0/2.33.1: the snapshot stops at 2.32.0); such an
    entry is provisional until ``refresh`` reads a manifest that carries it.
    """
    document = json.loads(table_path().read_text(encoding="utf-8"))
    return dict(document.get("from_docs") or {})


def lookup(release: str) -> Release:
    """The packages of ``release``; :class:`UnknownRelease` (naming the refresh command) if not listed."""
    releases = table()
    try:
        return releases[release]
    except KeyError:
        raise UnknownRelease(release, list(releases)) from None



def installed_mismatches(release: str, installed: Mapping[str, str | None]) -> list[str]:
    """Why the installed packages are not ``release``'s (empty: they are), one message per package.

    ``installed`` maps our package names (:data:`PACKAGES`) to installed versions (None: not installed).
    neuronx-cc must be installed and exact; torch-neuronx (the build keys pin, the release's newest torch
    line), neuronx-distributed and libneuronxla are checked when installed: a host without torch-neuronx
    serves HLO compiles only (:func:`workers.host.capabilities.detect_capabilities`), and one that has a package
    its release does not ship is not that release.
    """
    entry = lookup(release)
    problems = []

    def differs(package: str, have: str | None, want: str | None, required: bool, note: str = "") -> None:
        if have is None and not required:
            return
        have_base = base_version(have) if have else None
        if have_base != want:
            shown = have if have else "nothing"
            ships = want if want else "nothing"
            problems.append(f"{package}: installed {shown}, release {release} ships {ships}{note}")

    differs("neuronx-cc", installed.get("neuronx-cc"), entry.neuronx_cc, True)
    lines = ", ".join(entry.torch_neuronx)
    differs("torch-neuronx", installed.get("torch-neuronx"), entry.trace_torch_neuronx, False,
            f" (keys pin its newest torch line; the release lists {lines})" if len(entry.torch_neuronx) > 1 else "")
    differs("neuronx-distributed", installed.get("neuronx-distributed"), entry.neuronx_distributed, False)
    differs("neuronx-distributed-inference", installed.get("neuronx-distributed-inference"),
            entry.neuronx_distributed_inference, False)
    libxla = installed.get("libneuronxla")
    if libxla is not None and base_version(libxla) not in entry.libneuronxla:
        problems.append(f"libneuronxla: installed {libxla}, release {release} ships "
                        f"{' or '.join(entry.libneuronxla) or 'nothing'}")
    return problems

