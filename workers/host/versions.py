"""What this worker can compile, and the exact tool versions it compiles with.

Owns :func:`detect_capabilities` (sent when a worker registers, and the source of the queues it consumes)
and the version look-ups the backends record in every result. Nothing here imports torch or the Neuron
SDK at module level, and every probe tolerates their absence: a worker without torch must still register
(e.g. a neuronx-cc-only host compiling HLO).

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

import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from compilesvc.hostinfo import host_isa, instance_type
from compilesvc.spec import neuron_kinds, neuron_releases, neuron_toolchain
from compilesvc.spec.compile_spec import BACKEND_FORMATS, NEURON_TARGETS, SDK_RE
from compilesvc.spec.nxdi_transformers import transformers_for
from workers.isolation.child_env import output_changing_problems
from workers.isolation.sandbox import device_nodes

NEURON_SDK_ENV = "COMPILESVC_NEURON_SDK"
NEURON_TARGETS_ENV = "COMPILESVC_NEURON_TARGETS"

_VERSION_RE = re.compile(r"\b(\d+\.\d+(?:\.\d+){0,3}(?:\+[0-9A-Za-z.]+)?)")


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dist_version(distribution: str) -> str | None:
    """An installed distribution's version from its metadata (no import), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_version(module: str) -> str | None:
    """``module.__version__`` if the module imports, else None (never raises)."""
    if not module_available(module):
        return None
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # a half-installed SDK must not break registration
        return None


def python_version() -> str:
    return ".".join(str(part) for part in sys.version_info[:3])


def torch_version() -> str | None:
    """The installed torch's version, read from metadata so probing does not import torch."""
    if not module_available("torch"):
        return None
    return dist_version("torch") or module_version("torch")


def torch_neuronx_version() -> str | None:
    if not module_available("torch_neuronx"):
        return None
    return dist_version("torch-neuronx") or module_version("torch_neuronx")


def neuronx_distributed_version() -> str | None:
    """neuronx-distributed's version: package metadata, else its ``_version`` module (the real package keeps
    ``__version__`` there, not in ``__init__``)."""
    if not module_available("neuronx_distributed"):
        return None
    return dist_version("neuronx-distributed") or module_version("neuronx_distributed._version")


def nxdi_release_version(release: str) -> str | None:
    """The neuronx-distributed-inference version ``release`` ships (None: none, e.g. 2.32.0 or before 2.21)."""
    try:
        return neuron_releases.lookup(release).neuronx_distributed_inference
    except neuron_releases.UnknownRelease:
        return None


def neuronx_distributed_inference_version() -> str | None:
    """NxDI's version: package metadata, else its ``_version`` module (which says major.minor.0 only)."""
    if not module_available("neuronx_distributed_inference"):
        return None
    return (dist_version("neuronx-distributed-inference")
            or module_version("neuronx_distributed_inference._version"))


def nxdi_unavailable(release: str) -> str | None:
    """Why this host cannot run ``release``'s NxDI compiles (None: it can): the release must ship NxDI, and its
    exact version must be importable here with what it imports (torch-neuronx, neuronx-distributed, and
    transformers, which reads the checkpoint's config.json, at the exact version that NxDI's compiles run with:
    :mod:`compilesvc.spec.nxdi_transformers`)."""
    want = nxdi_release_version(release)
    if want is None:
        return f"Neuron SDK {release} ships no neuronx-distributed-inference"
    have = neuronx_distributed_inference_version()
    if have is None:
        return "neuronx-distributed-inference is not installed"
    if neuron_releases.base_version(have) != want:
        return f"neuronx-distributed-inference {have} is installed, Neuron SDK {release} ships {want}"
    missing = [*trace_packages_missing(), *(["neuronx-distributed"] if neuronx_distributed_version() is None else []),
               *(["transformers"] if transformers_version() is None else [])]
    if missing:
        return f"NxDI needs {' and '.join(missing)}, not installed"
    # transformers fills config.json's defaults into the compiled graph; the key implies it through NxDI's version.
    wanted = transformers_for(want)
    installed = transformers_version()
    if wanted is None:
        return f"no transformers version is known for neuronx-distributed-inference {want} (compilesvc.spec." \
               "nxdi_transformers): its compiles cannot be keyed"
    if installed is not None and neuron_releases.base_version(installed) != wanted:
        return (f"transformers {installed} is installed, neuronx-distributed-inference {want} (Neuron SDK {release}) "
                f"compiles with {wanted}")
    return None


def transformers_version() -> str | None:
    """The installed transformers' version, from its metadata (no import: importing it takes seconds)."""
    if not module_available("transformers"):
        return None
    return dist_version("transformers") or module_version("transformers")


def neuronx_cc_executable() -> str | None:
    return shutil.which("neuronx-cc")


def neuronx_cc_version(executable: str | None = None) -> str | None:
    """neuronx-cc's version: from ``neuronx-cc --version`` (the binary that compiles), else the package."""
    executable = executable or neuronx_cc_executable()
    if executable:
        try:
            proc = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=120)
            for line in (proc.stdout + proc.stderr).splitlines():
                if "version" in line.lower() and "python" not in line.lower():
                    match = _VERSION_RE.search(line)
                    if match:
                        return match.group(1)
        except (OSError, subprocess.SubprocessError):
            pass
    return dist_version("neuronx-cc") or module_version("neuronxcc")


def neuronxcc_package_version() -> str | None:
    """The version of the ``neuronxcc`` Python package: what torch-neuronx's trace calls into, which need not
    be the ``neuronx-cc`` executable on PATH (a second environment, a stray ``pip install --user``)."""
    if not module_available("neuronxcc"):
        return None
    return dist_version("neuronx-cc") or module_version("neuronxcc")


def compiler_disagreement(executable: str | None, executable_version: str | None,
                          package_version: str | None) -> list[str]:
    """Why the two neuronx-cc a worker can run are not one compiler (empty: they are, or one is absent).

    The HLO backend runs the executable and trace runs the package; a key names one neuronx-cc version,
    so both must be it.
    """
    if not (executable_version and package_version):
        return []
    if neuron_releases.base_version(executable_version) == neuron_releases.base_version(package_version):
        return []
    return [f"neuronx-cc: the executable on PATH ({executable}) is {executable_version} but the neuronxcc "
            f"package trace imports is {package_version}; install one neuronx-cc in the worker's environment"]


def installed_toolchain_differences(release: str, backend: str, tp_degree: int) -> list[str]:
    """How the importable Neuron packages differ from the toolchain a ``release`` compile's key names (empty:
    they do not; a package that is not importable is left to the backend, which reports the missing SDK).
    Raises ValueError for a release the table does not know."""
    wanted = neuron_toolchain.toolchain_material(release, backend, tp_degree)
    installed = {"neuronx-cc": neuronxcc_package_version(), "torch-neuronx": torch_neuronx_version(),
                 "neuronx-distributed": neuronx_distributed_version(), "libneuronxla": libneuronxla_version()}
    differences = []
    for package, want in wanted.items():
        have = installed.get(package)
        allowed = want if isinstance(want, list) else [want]
        if have is not None and neuron_releases.base_version(have) not in allowed:
            differences.append(f"{package} {have} is installed, the key names {' or '.join(allowed)}")
    return differences


def libneuronxla_version() -> str | None:
    if not module_available("libneuronxla"):
        return None
    return dist_version("libneuronxla") or module_version("libneuronxla")


def installed_neuron_packages(executable: str | None = None, neuronx_cc: str | None = None) -> dict[str, str | None]:
    """The installed Neuron packages' versions, by the release table's package names (None: not installed)."""
    return {"neuronx-cc": neuronx_cc or neuronx_cc_version(executable), "torch-neuronx": torch_neuronx_version(),
            "neuronx-distributed": neuronx_distributed_version(), "libneuronxla": libneuronxla_version(),
            "neuronx-distributed-inference": neuronx_distributed_inference_version()}


def neuron_manifest_versions(release: str | None, *, trace: bool) -> dict[str, str]:
    """What a Neuron compile's manifest records besides the compiler's own version: the release label, the
    runtime library that release ships (a serving host must match it; it is a system package, not checked
    here), and for trace the installed neuronx-distributed and libneuronxla."""
    out: dict[str, str] = {}
    if release:
        out["neuron_sdk"] = release
        known = neuron_releases.table().get(release)
        if known is not None and known.runtime_lib:
            out["aws_neuronx_runtime_lib"] = known.runtime_lib
    if trace:
        for name, version in (("neuronx_distributed", neuronx_distributed_version()),
                              ("libneuronxla", libneuronxla_version())):
            if version:
                out[name] = version
    return out


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


def trace_packages_missing() -> list[str]:
    """What this host lacks to run a trace: torch_neuronx importable, with torch (empty: nothing)."""
    return [name for name, version in (("torch", torch_version()), ("torch-neuronx", torch_neuronx_version()))
            if version is None]


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
            backend, tp_degree = neuron_kinds.kind_request(kind)
            queues.add(queue_name(target, caps["sdk"][target], backend, tp_degree=tp_degree))
    return sorted(queues)
