"""What this worker can compile: the capabilities it registers, and the queues they make it consume.

Owns :func:`detect_capabilities` (sent when a worker registers, and the source of the queues it consumes,
:func:`capability_queues`), built on the version probes of :mod:`workers.host.versions`.

Neuron SDK release: package versions (torch-neuronx 2.x.y.z, neuronx-cc 2.a.b.c) do not map one-to-one to
Neuron SDK releases ("2.20.0"), which is what specs name and queues are routed by. The host's release is
therefore configuration: ``COMPILESVC_NEURON_SDK`` (set it from the DLAMI/container image that installed
the SDK). Without it the worker offers no Neuron targets, since it cannot say which queue is its own.

The claim is checked (:func:`neuron_refusals`): the installed neuronx-cc, torch-neuronx, neuronx-distributed
and libneuronxla must be the exact versions the release table (:mod:`compilesvc.spec.neuron_releases`) lists for
that release, the release must be in the table, and the environment must hold no variable that changes
compiler output (:mod:`workers.isolation.child_env`). Any of these wrong and the worker offers no Neuron target and
``compilesvc worker`` refuses to start (exit 78, one line per problem): a key names the toolchain a release
resolves to, so a worker whose packages are another release's would publish artifacts under keys that lie.

Neuron targets: compiling needs the SDK, not the chip, so a host with neuronx-cc offers every target its release
supports (the instance families the SDK's manifest lists for that release's neuronx-cc:
:func:`compilesvc.spec.neuron_kinds.release_targets`; trn3 from 2.29.0), whatever its own instance type
(the DMI product name, :func:`compilesvc.hostinfo.instance_type`, is reported, not used to choose: each compile
sets ``NEURON_PLATFORM_TARGET_OVERRIDE`` to its target before the SDK is imported);
``COMPILESVC_NEURON_TARGETS`` (comma-separated, or ``none``) narrows that. Kinds of compile
(HLO, trace, tp > 1 trace: one queue each): those the release ships and the host has installed
(:func:`_offered_kinds`); a host with neuronx-cc and no torch-neuronx (all an SDK 2.32.0 host has) serves HLO.
A worker says how many Neuron devices it has (``neuron.devices``: the ``/dev/neuron*`` nodes the sandbox binds);
trace compiles of releases before SDK 2.21.0 need one (no ``cpu_backend``), so only such hosts offer them and
consume their queues, and the API refuses them, saying so, while no such worker is alive.
"""

from __future__ import annotations

import os
from typing import Any

from compilesvc.hostinfo import host_isa, instance_type
from compilesvc.spec import neuron_kinds, neuron_releases
from compilesvc.spec.compile_spec import BACKEND_FORMATS, NEURON_TARGETS, SDK_RE
from workers.host.versions import (
    NEURON_SDK_ENV,
    compiler_disagreement,
    installed_neuron_packages,
    module_available,
    neuronx_cc_executable,
    neuronx_cc_version,
    neuronxcc_package_version,
    nxdi_unavailable,
    python_version,
    torch_neuronx_version,
    torch_version,
    trace_packages_missing,
    transformers_version,
)
from workers.isolation.child_env import output_changing_problems
from workers.isolation.sandbox import device_nodes

NEURON_TARGETS_ENV = "COMPILESVC_NEURON_TARGETS"


def neuron_refusals(release: str, installed: dict[str, str | None], environ: dict[str, str]) -> list[str]:
    """Why this host must not compile for Neuron SDK ``release`` (empty: it may); see the module docstring."""
    try:
        mismatches = neuron_releases.installed_mismatches(release, installed)
        problems = [f"{NEURON_SDK_ENV}={release}: {p}" for p in mismatches]
    except neuron_releases.UnknownRelease as exc:
        problems = [f"{NEURON_SDK_ENV}={release}: {exc}"]
    return problems + output_changing_problems(environ)


def neuron_sdk_release(warnings: list[str]) -> str | None:
    """The host's Neuron SDK release from ``COMPILESVC_NEURON_SDK`` (see the module docstring).

    A value that is not a release as specs name it (major.minor.patch) would name a queue no spec reaches.
    """
    value = os.environ.get(NEURON_SDK_ENV, "").strip()
    if value and not SDK_RE.fullmatch(value):
        warnings.append(f"{NEURON_SDK_ENV}={value!r} is not a release such as 2.20.0: ignored")
        return None
    return value or None


def _neuron_targets(warnings: list[str]) -> list[str]:
    raw = os.environ.get(NEURON_TARGETS_ENV)
    if raw is None:
        return sorted(NEURON_TARGETS)
    if raw.strip().lower() in ("", "none"):
        return []
    wanted = [t.strip() for t in raw.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in NEURON_TARGETS]
    if unknown:
        warnings.append(f"{NEURON_TARGETS_ENV}: ignoring unknown target(s) {unknown}")
    return sorted({t for t in wanted if t in NEURON_TARGETS})


def detect_capabilities(devices: int | None = None) -> dict[str, Any]:
    """What this worker can compile. Shape::

        {"targets": ["cpu", "inf2", "trn1", "trn2"],            # targets it takes compiles for
         "sdk": {"cpu": "2.13.0", "inf2": "2.20.0", ...},       # per target: the spec "sdk" it serves
         "backends": {"cpu": ["aotinductor", "torchscript"], "inf2": ["neuronx-cc", "trace"], ...},
         "formats": {"hf-dir": false},                          # hf-dir needs transformers
         "isa": "x86_64-avx512",                                # aotinductor code is built for it
         "instance_type": "trn1.2xlarge" | null,
         "versions": {"python": ..., "torch": ... | null, "torch_neuronx": ... | null,
                      "neuronx_cc": ... | null, "transformers": ... | null},
         "neuron": {"release": "2.20.0" | null, "neuronx_cc_path": str | null,
                    "kinds": ["neuronx-cc", "neuronx-cc-tp", "trace", "trace-tp"],   # offered
                    "devices": 0,                                # Neuron device nodes (/dev/neuron*)
                    "packages": {"neuronx-cc": ..., "torch-neuronx": ..., ...},   # installed, exact
                    "release_packages": {...} | null,                             # what the release ships
                    "refused": ["why this worker must not start", ...]} | null,
         "warnings": ["why something is not offered", ...]}

    ``neuron.refused`` non-empty: the host claims a Neuron release (``COMPILESVC_NEURON_SDK`` is set) that its
    packages or environment contradict; no Neuron target is offered and ``compilesvc worker`` exits 78.
    """
    warnings: list[str] = []
    caps: dict[str, Any] = {
        "targets": [],
        "sdk": {},
        "backends": {},
        "formats": {},
        "isa": host_isa(),
        "instance_type": instance_type(),
        "versions": {"python": python_version()},
        "neuron": None,
        "warnings": warnings,
    }
    torch = torch_version()
    transformers = transformers_version()
    caps["versions"].update({"torch": torch, "transformers": transformers})
    caps["formats"]["hf-dir"] = transformers is not None
    if torch:
        caps["targets"].append("cpu")
        caps["sdk"]["cpu"] = neuron_releases.base_version(torch)  # "2.13.0+cpu" -> the spec form "2.13.0"
        caps["backends"]["cpu"] = sorted(BACKEND_FORMATS["cpu"])
    else:
        warnings.append("torch is not installed: no cpu target")

    executable = neuronx_cc_executable()
    has_compiler = executable is not None or module_available("neuronxcc")
    tnx = torch_neuronx_version()
    ncc = neuronx_cc_version(executable) if has_compiler else None
    caps["versions"].update({"torch_neuronx": tnx, "neuronx_cc": ncc})
    if has_compiler:
        refused: list[str] = []
        raw_release = os.environ.get(NEURON_SDK_ENV, "").strip()
        release = neuron_sdk_release(warnings)
        if raw_release and not release:
            refused.append(f"{NEURON_SDK_ENV}={raw_release!r} is not a release such as 2.27.1")
        packages = installed_neuron_packages(executable, ncc)
        caps["versions"].update({"neuronx_distributed": packages["neuronx-distributed"],
                                 "libneuronxla": packages["libneuronxla"],
                                 "neuronx_distributed_inference": packages["neuronx-distributed-inference"]})
        known = neuron_releases.table().get(release) if release else None
        if devices is None:  # else the pod's compile container's count (COMPILESVC_SANDBOX=pod: its probe)
            devices = len(device_nodes(os.environ))
        caps["neuron"] = {"release": release, "neuronx_cc_path": executable, "packages": packages,
                          "release_packages": known.as_versions() if known else None, "kinds": [],
                          "devices": devices, "refused": refused}
        targets = _neuron_targets(warnings)
        if not release:
            warnings.append(f"neuronx-cc is installed but {NEURON_SDK_ENV} names no release: no Neuron targets "
                            f"(package versions do not name the SDK release)")
        elif refusals := (compiler_disagreement(executable, ncc, neuronxcc_package_version())
                          + neuron_refusals(release, packages, dict(os.environ))):
            refused.extend(refusals)
            warnings.extend(f"no Neuron targets: {problem}" for problem in refusals)
        else:
            kinds = _offered_kinds(release, executable, not trace_packages_missing(), packages, devices, warnings)
            caps["neuron"]["kinds"] = kinds
            backends = sorted({neuron_kinds.kind_request(kind)[0] for kind in kinds})
            supported = neuron_kinds.release_targets(release)
            if lacking := [t for t in targets if t not in supported]:
                warnings.append(f"Neuron SDK {release} does not support target(s) {', '.join(lacking)} (its "
                                f"neuronx-cc lists {', '.join(supported)}): not offered")
            for target in [t for t in targets if t in supported] if kinds else []:
                caps["targets"].append(target)
                caps["sdk"][target] = release
                caps["backends"][target] = backends
    return caps


#: What this host must have for each kind of compile (:data:`compilesvc.spec.neuron_kinds.KIND_PACKAGES`):
#: the HLO backend runs the neuronx-cc executable, trace imports torch_neuronx (which calls the neuronxcc
#: package), tp > 1 trace imports neuronx_distributed.
_HOST_NEEDS = {"neuronx-cc": ("executable",), "neuronx-cc-tp": ("executable",), "trace": ("trace",),
               "trace-tp": ("trace", "nxd"), "nxdi": ("nxdi",)}
_HOST_PARTS = {"executable": "the neuronx-cc executable on PATH", "trace": "torch_neuronx with torch",
               "nxd": "neuronx_distributed", "nxdi": "neuronx_distributed_inference of the release's version"}


def _offered_kinds(release: str, executable: str | None, trace: bool, packages: dict[str, str | None],
                   devices: int, warnings: list[str]) -> list[str]:
    """The kinds of compile this host serves: those ``release`` ships (the one function specs are checked
    with, :func:`compilesvc.spec.neuron_kinds.release_kinds`) whose packages are installed here, and that
    it can run with ``devices`` Neuron devices (a trace before SDK 2.21.0 needs one:
    :func:`compilesvc.spec.neuron_kinds.device_requirement`). Each queue carries one kind, so a host with
    neuronx-cc alone (SDK 2.32.0 ships no torch-neuronx) serves HLO compiles, a device-less 2.19 host serves
    HLO and never the trace queues only device hosts consume; what it lacks is a warning, per kind."""
    nxdi_missing = nxdi_unavailable(release)
    have = {"executable": executable is not None, "trace": trace,
            "nxd": trace and packages.get("neuronx-distributed") is not None, "nxdi": nxdi_missing is None}
    kinds = []
    shipped = neuron_kinds.release_kinds(release)
    for kind in shipped:
        # An NxDI kind ("nxdi", and any "-tp" form the release table gives it) needs NxDI of the release's version.
        needs = _HOST_NEEDS.get(kind) or _HOST_NEEDS[kind.removesuffix("-tp")]
        lacking = [_HOST_PARTS[part] if part != "nxdi" else f"NxDI ({nxdi_missing})" for part in needs
                   if not have[part]]
        needs_device = neuron_kinds.device_requirement(release, *neuron_kinds.kind_request(kind))
        if lacking:
            warnings.append(f"Neuron SDK {release}: {kind} compiles not offered: missing {' and '.join(lacking)}")
        elif needs_device and not devices:
            warnings.append(f"not offered: {needs_device}; this host has none (no /dev/neuron*)")
        else:
            kinds.append(kind)
    for kind in [k for k in neuron_kinds.KIND_PACKAGES if k not in shipped]:
        try:
            neuron_kinds.require_kind(release, *neuron_kinds.kind_request(kind))
        except neuron_kinds.NotShipped as exc:  # always: says which package the release lacks
            warnings.append(str(exc))
    if not kinds:
        warnings.append(f"no Neuron targets: this host can run no kind of compile Neuron SDK {release} ships")
    return kinds


def trace_unavailable(release: str | None) -> str | None:
    """Why a worker on this host, configured for ``release``, would offer no trace compiles (None: it would):
    the verdict of :func:`_offered_kinds`, which :func:`detect_capabilities` registers, in words. For a release
    that names nothing the table knows (unset, or not a release) only the host's packages are judged."""
    missing = trace_packages_missing()
    try:
        shipped = neuron_kinds.release_kinds(release) if release else None
    except neuron_releases.UnknownRelease:
        shipped = None
    if shipped is None:
        return f"{' and '.join(missing)} not installed" if missing else None
    assert release is not None
    executable = neuronx_cc_executable()
    warnings: list[str] = []
    devices = len(device_nodes(os.environ))
    if "trace" in _offered_kinds(release, executable, not missing, installed_neuron_packages(executable), devices,
                                 warnings):
        return None
    try:
        neuron_kinds.require_kind(release, *neuron_kinds.kind_request("trace"))
    except neuron_kinds.NotShipped as exc:  # the release, not the host
        return str(exc)
    if missing:
        return f"{' and '.join(missing)} not installed"
    return "; ".join(w for w in warnings if "trace" in w) or f"no trace compiles for Neuron SDK {release}"


def capability_queues(caps: dict[str, Any]) -> list[str]:
    """The compile queues a worker with ``caps`` consumes (:func:`compilesvc.dispatch.routing.queue_name`)."""
    from compilesvc.dispatch.routing import queue_name

    queues = set()
    for target in caps["targets"]:
        if target == "cpu":
            for backend in caps["backends"].get(target, []):
                isa = caps["isa"] if backend == "aotinductor" else None
                queues.add(queue_name(target, caps["sdk"][target], backend, isa))
            continue
        for kind in caps["neuron"]["kinds"]:  # one queue per kind: "trace-tp" is trace at tp_degree > 1
            if kind == "nxdi" and target not in neuron_kinds.nxdi_targets(caps["sdk"][target]):
                continue  # the API refuses such specs (NxDI 2.29+: Trn2 and newer only): no queue to listen on
            backend, tp_degree = neuron_kinds.kind_request(kind)
            queues.add(queue_name(target, caps["sdk"][target], backend, tp_degree=tp_degree))
    return sorted(queues)
