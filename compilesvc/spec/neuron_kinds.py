"""What a Neuron SDK release can compile: the kinds of compile, the targets, and whether a host needs a device.

Built on the release table (:mod:`compilesvc.spec.neuron_releases`): a kind of compile (HLO, trace, tp > 1
trace, NxD Inference; one queue each) is available with a release that ships every package it runs; a target
with a release whose neuronx-cc lists its instance family; a trace of a release before SDK 2.21.0 needs a host
with a Neuron device. Specs are checked with these (422 naming the release) and workers offer what they allow.
"""

from __future__ import annotations

from compilesvc.spec.neuron_releases import Release, lookup, version_tuple


class TargetNotSupported(ValueError):
    """The release's compiler does not support the spec's target (``release``, ``target``)."""

    def __init__(self, release: str, target: str, supported: tuple[str, ...], reason: str = ""):
        self.release, self.target = release, target
        super().__init__(reason or f"Neuron SDK {release} does not support target {target}: its neuronx-cc lists "
                         f"the instance families {', '.join(supported) or 'none'} (the SDK's release manifest)")


class NotShipped(ValueError):
    """The release does not ship a package the requested compile needs (``release``, ``package``)."""

    def __init__(self, message: str, *, release: str = "", package: str = ""):
        self.release, self.package = release, package
        super().__init__(message)


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


# -- NxD Inference targets: narrower than the compiler's ---------------------------------------------------------

#: From this release NxDI runs on Trn2 and newer only: "NxD Inference models are now only supported on Trn2 and
#: newer hardware. Customers who require NxD Inference kernel support on Trn1 or Inf2 instances should pin to
#: release 2.28." (aws-neuron/aws-neuron-sdk@81ce03ae release-notes/components/nxd-inference.rst:61, NxD Inference
#: 0.9.17334, Neuron 2.29.0, Breaking Changes). The manifest still lists inf2/trn1 for its package; the notes win.
NXDI_TRN2_AND_NEWER_SINCE = "2.29.0"
NXDI_TRN2_AND_NEWER = ("trn2", "trn3")
#: Releases whose NxDI package the manifest lists for fewer families than their compiler: n2-manifest.json
#: (aws-neuron-sdk@81ce03ae) gives neuronx_distributed_inference 0.1.0 (2.21.0) and 0.2.0 (2.22.0)
#: ``supported_instances: ["inf2", "trn2"]``, where their neuronx-cc lists trn1 too (2.21.1's 0.1.1 lists trn1).
NXDI_MANIFEST_INSTANCES: dict[str, tuple[str, ...]] = {"2.21.0": ("inf2", "trn2"), "2.22.0": ("inf2", "trn2")}


def nxdi_targets(release: str) -> tuple[str, ...]:
    """The targets an NxD Inference compile of ``release`` may name: its compiler's, narrowed by NxDI's own
    support statements (:data:`NXDI_TRN2_AND_NEWER_SINCE`, :data:`NXDI_MANIFEST_INSTANCES`)."""
    targets = release_targets(release)
    if version_tuple(release) >= version_tuple(NXDI_TRN2_AND_NEWER_SINCE):
        return tuple(t for t in targets if t in NXDI_TRN2_AND_NEWER)
    if release in NXDI_MANIFEST_INSTANCES:
        return tuple(t for t in targets if t in NXDI_MANIFEST_INSTANCES[release])
    return targets


def require_nxdi_target(release: str, target: str) -> None:
    """Raise :class:`TargetNotSupported`, with NxDI's own reason, unless an NxD Inference compile of ``release``
    may target ``target`` (the compiler's support first: :func:`require_target`)."""
    require_target(release, target)
    supported = nxdi_targets(release)
    if target in supported:
        return
    if version_tuple(release) >= version_tuple(NXDI_TRN2_AND_NEWER_SINCE):
        why = (f"NxD Inference of Neuron SDK {release} does not support target {target}: from SDK "
               f"{NXDI_TRN2_AND_NEWER_SINCE} NxD Inference models are only supported on Trn2 and newer hardware "
               f"(NxD Inference 0.9.17334 release notes, Breaking Changes); use trn2 or trn3, or SDK 2.28.x for "
               f"{target}")
    else:
        why = (f"NxD Inference of Neuron SDK {release} does not support target {target}: the SDK's release "
               f"manifest lists its neuronx_distributed_inference for {', '.join(supported)} only")
    raise TargetNotSupported(release, target, supported, why)


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

    Releases sharing a queue (:func:`compilesvc.spec.neuron_toolchain.toolchain_release`) ship the same
    torch-neuronx, so they agree. An nxdi
    compile never does: NxD's ModelBuilder generates HLO with ``cpu_backend=True`` (neuronx-distributed@fbac349
    src/neuronx_distributed/trace/model_builder.py:L904-L911) and "Model compilation can be executed on a
    non-inf2 instance" (aws-neuron-sdk@81ce03a deploy/ec2/inference-inf2.rst:L23-L25), and every release that
    ships NxDI (2.21.0+) is at or after :data:`CPU_BACKEND_SINCE`."""
    if backend != "trace" or trace_has_cpu_backend(release):
        return None
    return (f"{KIND_TITLES[compile_kind(backend, tp_degree)]} compiles of Neuron SDK {release} need a host with a "
            f"Neuron device: torch_neuronx.trace has no cpu_backend before SDK {CPU_BACKEND_SINCE} "
            f"(aws-neuron-sdk#910)")
