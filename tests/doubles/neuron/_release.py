"""TEST DOUBLE support: which Neuron SDK release the double emulates, and that release's package versions.

Not part of the real SDK (the real packages carry no such module). Everything release-dependent in the
double (version strings, error-code style, which NxD APIs exist) is read from here, and tests import the
table to know what to expect: ``from tests.doubles.neuron._release import RELEASES``.

The emulated *installed* release is ``COMPILESVC_NEURON_DOUBLE_RELEASE`` (default :data:`DEFAULT_RELEASE`),
read when asked (not at import), so a test can emulate a host whose packages are another release than the
one ``COMPILESVC_NEURON_SDK`` claims. Standard library only: bin/neuronx-cc imports it too.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass

RELEASE_ENV = "COMPILESVC_NEURON_DOUBLE_RELEASE"
#: Simulated Neuron device count; unset: real ``/dev/neuron*`` nodes decide (see :func:`device_count`).
DEVICES_ENV = "COMPILESVC_NEURON_DOUBLE_DEVICES"
#: The platform a host *with* devices auto-detects (the real SDK reads the instance type); default trn1.
PLATFORM_ENV = "COMPILESVC_NEURON_DOUBLE_PLATFORM"
BEHAVIOUR_ENV = "COMPILESVC_NEURON_DOUBLE_BEHAVIOUR"
#: A file whose existence makes neuronx-cc fail with the code it holds (a lost race; see behaviour_from).
RACE_ENV = "COMPILESVC_NEURON_DOUBLE_RACE_FILE"
#: Rendezvous port parallel_model_trace hard-codes (2022, see neuronx_distributed/trace); tests may move it.
PMT_PORT_ENV = "COMPILESVC_NEURON_DOUBLE_PMT_PORT"
DEFAULT_RELEASE = "2.27.1"
#: Every --target value some release's neuronx-cc takes (CLI reference: inf2|trn1|trn1n|trn2; trn3: SDK examples
#: pass --target trn3, NKI's quickstart sets NEURON_PLATFORM_TARGET_OVERRIDE=trn3). Which ones a given release
#: takes: :func:`targets`.
TARGETS = ("inf2", "trn1", "trn1n", "trn2", "trn3")
#: The first release whose compiler lists each instance family, from n2-manifest.json's ``supported_instances``
#: of the neuronx-cc package (manifest_version 2.32.0, commit 81ce03ae): trn1 from 2.3.0, inf2 from 2.8.0,
#: trn2 from 2.21.0, trn3 from 2.29.0. trn1n is a trn1 (the manifest lists no trn1n package row) and goes
#: with trn1.
TARGET_SINCE = {"trn1": (2, 3, 0), "trn1n": (2, 3, 0), "inf2": (2, 8, 0), "trn2": (2, 21, 0), "trn3": (2, 29, 0)}
#: --logical-nc-config / --lnc / -lnc: introduced with Neuron 2.21.0 (release-notes/components/compiler.rst,
#: "This release introduces the --logical-nc-config or -lnc compiler command line option ... The compiler's
#: default is LNC=2"), values {1, 2}.
LNC_SINCE = (2, 21, 0)
#: Targets with logical NeuronCores, whose compiler default is LNC 2: trn2 (CLI reference, compiler/
#: neuronx-cc/api-reference-guide/index.rst: "Only available on trn2; Default: 2") and trn3 (about-neuron/arch/
#: neuron-features/logical-neuroncore-config.rst: "LNC applies only to Trn2 and Trn3 instances";
#: neuronx-distributed utils/model_utils.py get_platform_lnc and NxDI models/config.py get_platform_lnc: 2 on
#: trn2 and trn3, else 1). The compiler's own default on trn3 is not written down anywhere we found: the double
#: takes NxD's. Elsewhere only 1 (compiler/error-codes/EARG001.rst: "On trn1, only lnc=1 is supported").
LNC_TARGETS = ("trn2", "trn3")
#: How ModelBuilder's ``logical_nc_config`` reaches the double's neuronx-cc, which records it in the NEFF next
#: to its own LNC (not an SDK variable: the real value shapes NxD's replica groups inside the HLO).
NXD_LNC_ENV = "COMPILESVC_NEURON_DOUBLE_NXD_LNC"


@dataclass(frozen=True)
class Release:
    """Exact package versions of one SDK release, as the release manifest lists them."""

    release: str
    neuronx_cc: str
    torch_neuronx: str | None  # None: the release ships none (2.32.0), so the double installs none
    neuronx_distributed: str | None
    runtime: str  # aws-neuronx-runtime-lib
    python: str  # the DLC image's Python (REFERENCE.md: <= 2.25 py310, 2.26.1 py311, 2.27.1 py312)
    #: neuronx-distributed-inference (NxDI), the manifest's ``neuronx_distributed_inference`` entry (research:
    #: docs/research/nxdi.md §0); None where the release ships none (before 2.21, and 2.32.0).
    nxdi: str | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        """The double's top-level modules this release's install has (``neuronxcc`` always)."""
        shipped = {"neuronxcc": self.neuronx_cc, "torch_neuronx": self.torch_neuronx,
                   "neuronx_distributed": self.neuronx_distributed,
                   "neuronx_distributed_inference": self.nxdi}
        return tuple(module for module, version in shipped.items() if version)

    @property
    def tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.release.split("."))

    @property
    def build_hash(self) -> str:
        """The ``+<hash>`` suffix of installed versions. The manifest has no hashes: the double derives one."""
        return hashlib.sha1(self.neuronx_cc.encode()).hexdigest()[:8]


# Source: aws-neuron/aws-neuron-sdk src/helperscripts/n2-manifest.json (manifest_version 2.32.0, commit
# 81ce03ae), "neuron_releases" entries for neuronx-cc, torch-neuronx, neuronx_distributed,
# aws-neuronx-runtime-lib. Where a release ships several torch-neuronx builds, the newest torch line is
# taken. 2.27.0/2.27.1 ship identical packages (as do 2.24.0/2.24.1): a release label is not a toolchain.
RELEASES: dict[str, Release] = {r.release: r for r in (
    Release("2.19.0", "2.14.213.0", "2.1.2.2.2.0", "0.8.0", "2.21.41.0", "3.10"),
    Release("2.20.0", "2.15.128.0", "2.1.2.2.3.0", "0.9.0", "2.22.14.0", "3.10"),
    Release("2.25.0", "2.20.9961.0", "2.7.0.2.9.9357", "0.14.18461", "2.27.23.0", "3.10", "0.5.9230"),
    Release("2.26.0", "2.21.18209.0", "2.8.0.2.10.13553", "0.15.22404", "2.28.23.0", "3.11", "0.6.10598"),
    Release("2.26.1", "2.21.33363.0", "2.8.0.2.10.16998", "0.15.22404", "2.28.23.0", "3.11", "0.6.10598"),
    Release("2.27.0", "2.22.12471.0", "2.9.0.2.11.19912", "0.16.25997", "2.29.40.0", "3.12", "0.7.14366"),
    Release("2.27.1", "2.22.12471.0", "2.9.0.2.11.19912", "0.16.25997", "2.29.40.0", "3.12", "0.7.15063"),
    Release("2.28.0", "2.23.6484.0", "2.9.0.2.12.22436", "0.17.26814", "2.30.51.0", "3.12", "0.8.16251"),
    # The first release listing trn3 (every package's supported_instances), and the newest with torch-neuronx
    # and NxD. Python: the manifest lists 3.10-3.12 (2.29.0) and 3.11-3.13 (2.31.1); which one the DLC ships is
    # unverified (the double does not use it).
    Release("2.29.0", "2.24.5133.0", "2.9.0.2.13.24727", "0.18.27753", "2.31.24.0", "3.12", "0.9.17334"),
    # The last release before, and the first with, the compiler fix of "non-deterministic compilation
    # failures" (compiler release notes, 2.31.0). Python: unverified (as 2.28.0's).
    Release("2.30.0", "2.25.3371.0", "2.9.0.2.14.27725", "0.19.28093", "2.32.31.0", "3.12", "0.10.17970"),
    Release("2.31.0", "2.26.6360.0", "2.9.0.2.15.32035", "0.19.28492", "2.33.10.0", "3.12", "0.10.18399"),
    Release("2.31.1", "2.26.6360.0", "2.9.0.2.15.32035", "0.19.28492", "2.33.10.0", "3.12", "0.10.18399"),
    # 2.32.0 lists neuronx-cc 2.27.5334.0 and no torch-neuronx or neuronx_distributed package (the XLA-based
    # torch-neuronx is in maintenance from 2.32: archive/frameworks/torch/inference-torch-neuronx.rst; NxD
    # has no release after 2.31: announce-nxdi-maintenance-support-2-31.rst). A host of it has the compiler
    # alone. Python: unverified (no torch-neuronx DLC of 2.32.0 to read it from); the double does not use it.
    Release("2.32.0", "2.27.5334.0", None, None, "2.34.10.0", "3.12"),
    # 2.33.0/2.33.1: from the SDK's release pages, not the manifest (the snapshot reachable here stops at
    # 2.32.0; compilesvc/spec/neuron_releases.json "from_docs" cites them). 2.33.0 lists torch-neuronx again
    # (2.9.0.2.15.32035, v2.33.0 release-notes/releasecontent.html) and no NxD. Python 3.14: "Starting with
    # Neuron 2.33.0, Neuron DLC images are published on Ubuntu 26.04 only ... (Python 3.14)"
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/setup/pytorch/update-dlc.html). 2.33.1 repeats
    # 2.33.0's packages (unverified: no page lists them).
    Release("2.33.0", "2.28.7631.0", "2.9.0.2.15.32035", None, "2.35.30.0", "3.14"),
    Release("2.33.1", "2.28.7631.0", "2.9.0.2.15.32035", None, "2.35.30.0", "3.14"),
)}

# Release-dependent behaviour, each with its source:
#: Compilers before this release print bare codes (``[NLA001]``, ``[XTP002]``, ``[TEN404]``, ``[F134]``):
#: aws-neuron-sdk#948 shows ``[NLA001]`` from neuronx-cc 2.14.227 (SDK 2.19.1); ``NCC_``-prefixed codes are
#: seen from neuronx-cc 2.24 (aws-neuron-sdk#1314, SDK 2.29) and in the 2.27 error-code docs. Releases in
#: between are unverified: the double draws the line at 2.21.0 (the first 2.2x compiler line, 2.16.x).
NCC_CODES_SINCE = (2, 21, 0)
#: neuronx_distributed.trace.model_builder first ships with the SDK 2.20.0 release of neuronx-distributed
#: (aws-neuron/neuronx-distributed commit 4f95471 "Neuron SDK Release 2.20.0" adds model_builder.py).
MODEL_BUILDER_SINCE = (2, 20, 0)
#: ModelBuilder(compiler_flag_hook=...) is new in 2.26.0 (release-notes/prev/2.26.0/nxd-core.rst).
COMPILER_FLAG_HOOK_SINCE = (2, 26, 0)
#: parallel_model_trace: 2.26.0 is the last release supporting it (announce-deprecation-nxd-path-trace-api),
#: unsupported from 2.27 (announcement-end-of-support-parallel-model-trace.rst).
PMT_DEPRECATED_SINCE = (2, 26, 0)
#: ``torch_neuronx.trace(..., cpu_backend=...)``: the keyword is new in the 2.21.0 trace API reference
#: (aws-neuron/aws-neuron-sdk commit 752349fd "Neuron SDK Release 2.21.0" adds it to the signature in
#: frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.rst); before it a
#: device-less host cannot trace (aws-neuron-sdk#910: "a Neuron device is currently required").
CPU_BACKEND_SINCE = (2, 21, 0)
#: ModelBuilder compiles through ``neuron_xla_compile(use_cache=True, cache_dir=None, ...)`` from the 2.23.0
#: release (aws-neuron/neuronx-distributed commit e834945 "Release 2.23.0", trace/model_builder.py
#: ``submit_compilation_job_with_cache``): the Neuron persistent compile cache.
COMPILE_CACHE_SINCE = (2, 23, 0)
PMT_UNSUPPORTED_SINCE = (2, 27, 0)


def targets(release: Release) -> tuple[str, ...]:
    """The --target values ``release``'s neuronx-cc takes (:data:`TARGET_SINCE`)."""
    return tuple(t for t in TARGETS if release.tuple >= TARGET_SINCE[t])


def default_lnc(target: str) -> int:
    """The compiler's logical NeuronCore config for ``target`` when no --logical-nc-config is given."""
    return 2 if target in LNC_TARGETS else 1


def current() -> Release:
    """The emulated installed release (``COMPILESVC_NEURON_DOUBLE_RELEASE``); unknown labels are a test bug."""
    label = os.environ.get(RELEASE_ENV, "").strip() or DEFAULT_RELEASE
    try:
        return RELEASES[label]
    except KeyError:
        raise RuntimeError(f"Neuron TEST DOUBLE: {RELEASE_ENV}={label!r} is not a release the double knows "
                           f"({', '.join(RELEASES)}); see tests/doubles/neuron/_release.py") from None


def device_count() -> int:
    """Neuron devices on this host: ``/dev/neuron*`` nodes (how the runtime finds them), unless the test
    override ``COMPILESVC_NEURON_DOUBLE_DEVICES`` says otherwise."""
    override = os.environ.get(DEVICES_ENV, "").strip()
    if override:
        return int(override)
    return len(glob.glob("/dev/neuron[0-9]*"))


def detected_platform() -> str | None:
    """The platform target the SDK would pick now: the override, else the host's own (needs a device)."""
    override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
    if override:
        return override
    if device_count() > 0:
        return os.environ.get(PLATFORM_ENV, "").strip() or "trn1"
    return None


def behaviour_from(args: list[str]) -> str:
    """The test channel: ``--double-behaviour=<b>`` / ``--double-behaviour <b>`` wins over the variable."""
    for i, arg in enumerate(args):
        if arg.startswith("--double-behaviour="):
            return arg.partition("=")[2]
        if arg == "--double-behaviour" and i + 1 < len(args):
            return args[i + 1]
    race = os.environ.get(RACE_ENV)
    if race and os.path.isfile(race):
        # A non-deterministic failure (compiler release notes 2.30.0/2.31.0: data races in control flow
        # validation): the compile fails with the file's code while the file exists. The test removes it to
        # let the next attempt win the race; a compile sandbox keeps no state of its own between attempts, so
        # the double cannot count attempts itself (the file's directory is a read-only bind).
        with open(race) as handle:
            return f"ncc-error:{handle.read().strip() or 'NCC_CFG015'}"
    return os.environ.get(BEHAVIOUR_ENV) or "ok"


def coded(code: str, release: Release) -> str:
    """How ``code`` (``NCC_E…``/``NCC_I…`` or bare) is printed by ``release``'s compiler.

    New compilers: ``NCC_`` + E (user-facing) / I (internal) + component + number; old ones print the
    component + number alone (NCC_INLA001 <-> NLA001, NCC_ITEN404 <-> TEN404: #948 vs #1314).
    """
    if release.tuple >= NCC_CODES_SINCE or not code.startswith(("NCC_E", "NCC_I")):
        return code  # NCC_CFG… (compiler release notes, 2.29.0) has no bare form on record
    return code[5:]
