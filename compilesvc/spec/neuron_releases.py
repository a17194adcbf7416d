"""The Neuron SDK release table: which exact packages each SDK release ships.

Owns ``compilesvc/neuron_releases.json`` (our format, generated from the SDK's own release manifest,
aws-neuron/aws-neuron-sdk ``src/helperscripts/n2-manifest.json``), the look-ups built on it, and the
conversion behind ``compilesvc neuron-releases refresh``. Package versions are not release numbers (SDK
2.27.1 ships neuronx-cc 2.22.12471.0, torch-neuronx 2.9.0.2.11.19912, …), and consecutive releases can ship
identical packages (2.27.0/2.27.1, 2.24.0/2.24.1). Two consumers need the exact versions:

- the key (:func:`toolchain_material`): a Neuron key names the toolchain a release resolves to, not the
  release label (docs/keys.md, "Toolchain");
- the worker: it checks that its installed packages are the release it claims before it registers
  (:func:`installed_mismatches`, used by :mod:`workers.host.versions`).

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


class TargetNotSupported(ValueError):
    """The release's compiler does not support the spec's target (``release``, ``target``)."""

    def __init__(self, release: str, target: str, supported: tuple[str, ...]):
        self.release, self.target = release, target
        super().__init__(f"Neuron SDK {release} does not support target {target}: its neuronx-cc lists the instance "
                         f"families {', '.join(supported) or 'none'} (the SDK's release manifest)")


class NotShipped(ValueError):
    """The release does not ship a package the requested compile needs (``release``, ``package``)."""

    def __init__(self, message: str, *, release: str = "", package: str = ""):
        self.release, self.package = release, package
        super().__init__(message)


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


def lookup(release: str) -> Release:
    """The packages of ``release``; :class:`UnknownRelease` (naming the refresh command) if not listed."""
    releases = table()
    try:
        return releases[release]
    except KeyError:
        raise UnknownRelease(release, list(releases)) from None


# -- compile kinds: what a release can compile ----------------------------------------------------------------

#: The kinds of Neuron compile, as queue names spell them (compilesvc.dispatch.routing), and the packages each
#: runs, in the order they are needed: an HLO compile is neuronx-cc alone (tp > 1 compiles one rank's program
#: as given); trace is torch-neuronx (which calls neuronx-cc); tp > 1 trace adds neuronx-distributed; an NxD
#: Inference compile (hf-checkpoint) runs NxDI on NxD's ModelBuilder, at any tp degree (one kind: NxDI shards
#: inside one process, so its tp does not change what a host needs); NxDI is listed first so that a release
#: without it (2.32.0) is refused naming it.
KIND_PACKAGES: dict[str, tuple[str, ...]] = {
    "neuronx-cc": ("neuronx-cc",),
    "neuronx-cc-tp": ("neuronx-cc",),
    "trace": ("neuronx-cc", "torch-neuronx"),
    "trace-tp": ("neuronx-cc", "torch-neuronx", "neuronx-distributed"),
    "nxdi": ("neuronx-distributed-inference", "neuronx-cc", "torch-neuronx", "neuronx-distributed"),
}
#: What each kind is called where a person reads it (errors, docs/neuron-hosts.md's support matrix).
KIND_TITLES = {"neuronx-cc": "HLO (neuronx-cc)", "neuronx-cc-tp": "HLO tp > 1 (neuronx-cc)",
               "trace": "trace (torch-neuronx)", "trace-tp": "trace tp > 1 (torch-neuronx with NxD)",
               "nxdi": "LLM (NxD Inference)"}
#: Backends whose tp degree does not make another kind of compile.
_TP_AGNOSTIC = frozenset({"nxdi"})


def compile_kind(backend: str, tp_degree: int) -> str:
    """The kind of a Neuron compile by ``backend`` at ``tp_degree`` (a key of :data:`KIND_PACKAGES`)."""
    kind = f"{backend}-tp" if tp_degree > 1 and backend not in _TP_AGNOSTIC else backend
    if kind not in KIND_PACKAGES:
        raise ValueError(f"{backend!r} is not a Neuron backend; expected neuronx-cc, trace or nxdi")
    return kind


def kind_request(kind: str) -> tuple[str, int]:
    """The backend and a tp_degree that make a compile of ``kind``: :func:`compile_kind`'s inverse."""
    backend = kind.removesuffix("-tp")
    return backend, 2 if kind != backend else 1


def _ships(entry: Release, package: str) -> bool:
    return bool({"neuronx-cc": entry.neuronx_cc, "torch-neuronx": entry.torch_neuronx,
                 "neuronx-distributed": entry.neuronx_distributed,
                 "neuronx-distributed-inference": entry.neuronx_distributed_inference}[package])


def release_kinds(release: str) -> tuple[str, ...]:
    """The kinds of compile ``release`` ships every package of, in :data:`KIND_PACKAGES`' order: what specs may
    ask of it and what its workers may offer (:class:`UnknownRelease` for a release the table does not list)."""
    entry = lookup(release)
    return tuple(kind for kind, needs in KIND_PACKAGES.items() if all(_ships(entry, p) for p in needs))


def require_kind(release: str, backend: str, tp_degree: int) -> None:
    """Raise :class:`NotShipped`, naming the release and the first package it lacks, unless ``release`` ships
    what a ``backend`` compile at ``tp_degree`` runs (:class:`UnknownRelease` for an unlisted release)."""
    kind = compile_kind(backend, tp_degree)
    if kind in release_kinds(release):
        return
    entry = lookup(release)
    missing = next(p for p in KIND_PACKAGES[kind] if not _ships(entry, p))
    offered = ", ".join(KIND_TITLES[k] for k in release_kinds(release)) or "nothing"
    raise NotShipped(f"Neuron SDK {release} ships no {missing}: {KIND_TITLES[kind]} compiles are not available "
                     f"with it (it supports {offered})", release=release, package=missing)


def release_targets(release: str) -> tuple[str, ...]:
    """The Neuron targets ``release`` supports, from the instance families its manifest entry lists
    (:class:`UnknownRelease` for a release the table does not list)."""
    return lookup(release).targets


def require_target(release: str, target: str) -> None:
    """Raise :class:`TargetNotSupported`, naming the release and the target, unless ``release``'s compiler lists
    ``target``'s instance family: a trn3 spec for a release before 2.29.0 has no compiler that can build it."""
    supported = release_targets(release)
    if target not in supported:
        raise TargetNotSupported(release, target, supported)


# -- trace without a device: what a compile host must have ----------------------------------------------------

#: The first release whose ``torch_neuronx.trace`` takes ``cpu_backend`` (it first appears in that release's
#: trace API reference: aws-neuron/aws-neuron-sdk commit 752349fd "Neuron SDK Release 2.21.0",
#: frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.rst). Before it a
#: host without a Neuron device cannot trace (aws-neuron-sdk#910), and NxD's parallel_model_trace, which tp > 1
#: traces of those releases use, needs a device for its rank processes too.
CPU_BACKEND_SINCE = "2.21.0"


def trace_has_cpu_backend(release: str) -> bool:
    """Whether ``torch_neuronx.trace`` of ``release`` takes ``cpu_backend`` (traces on a device-less host)."""
    return version_tuple(release) >= version_tuple(CPU_BACKEND_SINCE)


def device_requirement(release: str, backend: str, tp_degree: int) -> str | None:
    """Why a ``backend`` compile of ``release`` needs a host with a Neuron device, or None when it does not.

    Releases sharing a queue (:func:`toolchain_release`) ship the same torch-neuronx, so they agree. An nxdi
    compile never does: NxD's ModelBuilder generates HLO with ``cpu_backend=True`` (neuronx-distributed@fbac349
    src/neuronx_distributed/trace/model_builder.py:L904-L911) and "Model compilation can be executed on a
    non-inf2 instance" (aws-neuron-sdk@81ce03a deploy/ec2/inference-inf2.rst:L23-L25), and every release that
    ships NxDI (2.21.0+) is at or after :data:`CPU_BACKEND_SINCE`."""
    if backend != "trace" or trace_has_cpu_backend(release):
        return None
    return (f"{KIND_TITLES[compile_kind(backend, tp_degree)]} compiles of Neuron SDK {release} need a host with a "
            f"Neuron device: torch_neuronx.trace has no cpu_backend before SDK {CPU_BACKEND_SINCE} "
            f"(aws-neuron-sdk#910)")


def toolchain_material(release: str, backend: str, tp_degree: int) -> dict[str, Any]:
    """The exact toolchain a Neuron compile of ``release`` with ``backend`` runs: the key's ``neuron`` part.

    Only what the backend runs: an HLO compile is neuronx-cc alone; trace adds torch-neuronx (whose version
    names its torch, e.g. 2.9.0.x) and libneuronxla (the lowering plugin), and tp > 1 neuronx-distributed;
    nxdi (any tp) all of those and neuronx-distributed-inference (issue 29's key: NxDI, NxD, torch-neuronx,
    neuronx-cc exact versions). :class:`NotShipped` where the release lacks one of them (:func:`require_kind`).
    """
    require_kind(release, backend, tp_degree)
    entry = lookup(release)
    material: dict[str, Any] = {"neuronx-cc": entry.neuronx_cc}
    if backend in ("trace", "nxdi"):
        material["torch-neuronx"] = entry.trace_torch_neuronx
        material["libneuronxla"] = sorted(entry.libneuronxla, key=version_tuple)
        if tp_degree > 1 or backend == "nxdi":
            material["neuronx-distributed"] = entry.neuronx_distributed
    if backend == "nxdi":
        material["neuronx-distributed-inference"] = entry.neuronx_distributed_inference
    return material


@functools.lru_cache(maxsize=256)
def toolchain_release(release: str, backend: str, tp_degree: int) -> str:
    """The oldest release whose toolchain for this kind of compile is ``release``'s: the name its queue uses.

    Keys hold the toolchain, not the label, so releases shipping identical packages share compiles; their
    queue must be shared too, or a build joining a compile first queued under another label would wait on
    a queue its own release's workers never read. Only what the compile runs counts (an HLO compile:
    neuronx-cc alone), so two releases can share HLO queues and not trace queues.
    """
    material = toolchain_material(release, backend, tp_degree)
    for label in table():
        try:
            if toolchain_material(label, backend, tp_degree) == material:
                return label
        except NotShipped:
            continue
    return release  # pragma: no cover - release itself always matches


def toolchain_differences(requested: str, installed: str, backend: str, tp_degree: int) -> list[str]:
    """How the toolchain a compile of ``requested`` runs differs from ``installed``'s (empty: identical)."""
    want = toolchain_material(requested, backend, tp_degree)
    try:
        have = toolchain_material(installed, backend, tp_degree)
    except NotShipped as exc:
        return [str(exc)]
    return [f"{package}: release {requested} has {want.get(package)}, this host's {installed} has "
            f"{have.get(package)}" for package in sorted(want.keys() | have.keys())
            if want.get(package) != have.get(package)]


def installed_mismatches(release: str, installed: Mapping[str, str | None]) -> list[str]:
    """Why the installed packages are not ``release``'s (empty: they are), one message per package.

    ``installed`` maps our package names (:data:`PACKAGES`) to installed versions (None: not installed).
    neuronx-cc must be installed and exact; torch-neuronx (the build keys pin, the release's newest torch
    line), neuronx-distributed and libneuronxla are checked when installed: a host without torch-neuronx
    serves HLO compiles only (:func:`workers.host.versions.detect_capabilities`), and one that has a package
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


# -- refresh: the SDK's manifest -> our table ---------------------------------------------------------------

def from_sdk_manifest(document: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Our table entries from the SDK's ``n2-manifest.json`` document: every release that ships neuronx-cc.

    Raises ValueError for a document that is not in the SDK's shape.
    """
    releases = document.get("neuron_releases") if isinstance(document, Mapping) else None
    if not isinstance(releases, list):
        raise ValueError("not an SDK release manifest: no \"neuron_releases\" list")
    out: dict[str, dict[str, Any]] = {}
    for item in releases:
        try:
            label = str(item["neuron_version"])
            packages = list(item["packages"])
        except (TypeError, KeyError) as exc:
            raise ValueError(f"not an SDK release manifest: a release entry lacks {exc}") from None
        found: dict[str, set[str]] = {name: set() for name in PACKAGES}
        families: set[str] = set()
        for package in packages:
            name, version = package.get("name"), package.get("version")
            instances = set(package.get("supported_instances") or ())
            if instances and not instances - {"inf1"}:
                continue  # the inf1 (neuron, not neuronx) build of a package: another SDK family
            if name == "neuronx-cc":
                families |= instances - {"inf1"}
            for ours, theirs in PACKAGES.items():
                if name in theirs and version:
                    found[ours].add(str(version))
        if not found["neuronx-cc"]:
            continue
        entry: dict[str, Any] = {}
        for ours, versions in found.items():
            ordered = sorted(versions, key=version_tuple, reverse=True)
            if ours in MULTI:
                entry[ours] = ordered
            elif len(ordered) > 1:
                raise ValueError(f"release {label} lists several {ours} versions: {ordered}")
            else:
                entry[ours] = ordered[0] if ordered else None
        # The instance families the release's compiler supports: what specs of it may name as target.
        entry["instances"] = sorted(families)
        out[label] = entry
    if not out:
        raise ValueError("the SDK manifest lists no release that ships neuronx-cc")
    return out


def refreshed_document(current: Mapping[str, Any] | None, sdk_document: Mapping[str, Any],
                       source: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """Our table document with ``sdk_document``'s releases merged into ``current``'s.

    Returns (document, added release labels, changed release labels). Releases missing from the SDK's file
    are kept: a release, once published, does not change, and dropping it would refuse its specs.
    """
    new = from_sdk_manifest(sdk_document)
    old: dict[str, Any] = dict((current or {}).get("releases") or {})
    added = sorted((label for label in new if label not in old), key=version_tuple)
    changed = sorted((label for label in new if label in old and old[label] != new[label]), key=version_tuple)
    merged = {**old, **new}
    document = {
        "format": TABLE_FORMAT,
        "source": {
            "from": source,
            "upstream": "aws-neuron/aws-neuron-sdk src/helperscripts/n2-manifest.json",
            "manifest_version": sdk_document.get("manifest_version"),
            "manifest_date": sdk_document.get("manifest_date"),
        },
        "note": ("Generated by `compilesvc neuron-releases refresh`; do not edit by hand. Per SDK release, the "
                 "exact versions of the packages compilesvc checks and keys by (multi-build packages newest "
                 "first; aws-neuronx-runtime-lib is the non-inf1 build), and the instance families its "
                 "neuronx-cc supports (supported_instances)."),
        "releases": {label: merged[label] for label in sorted(merged, key=version_tuple)},
    }
    return document, added, changed


def write_table(document: Mapping[str, Any], path: Path) -> None:
    """Write a table document the way it is committed (stable order, one release per line group)."""
    path.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    table.cache_clear()
