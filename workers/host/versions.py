"""The exact tool versions this worker compiles with, and whether they are a Neuron SDK release's.

Owns the version look-ups the backends record in every result and check before compiling (the installed
packages against the release table, :mod:`compilesvc.spec.neuron_releases`; NxD Inference's transformers
against :mod:`compilesvc.spec.nxdi_transformers`), and ``COMPILESVC_NEURON_SDK``, the release a host claims
(package versions do not name the release). What the worker offers, built on these, is
:mod:`workers.host.capabilities`. Nothing here imports torch or the Neuron SDK at module level, and every probe
tolerates their absence: a worker without torch must still register (e.g. a neuronx-cc-only host compiling HLO).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys

from compilesvc.spec import neuron_releases, neuron_toolchain
from compilesvc.spec.nxdi_transformers import transformers_for

NEURON_SDK_ENV = "COMPILESVC_NEURON_SDK"

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


def trace_packages_missing() -> list[str]:
    """What this host lacks to run a trace: torch_neuronx importable, with torch (empty: nothing)."""
    return [name for name, version in (("torch", torch_version()), ("torch-neuronx", torch_neuronx_version()))
            if version is None]
