"""The exact Neuron toolchain a compile runs: the ``neuron`` part of its key, and the queue its release shares.

A Neuron key names the packages a release resolves to for the kind of compile asked (docs/keys.md,
"Toolchain"), not the release label, so releases shipping identical packages share compiles and queues.
"""

from __future__ import annotations

import functools
from typing import Any

from compilesvc.spec.neuron_kinds import NotShipped, require_kind
from compilesvc.spec.neuron_releases import lookup, table, version_tuple


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
