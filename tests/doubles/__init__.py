"""Test doubles: stand-ins for software that cannot be installed on the test hosts.

``tests/doubles/neuron/`` is a TEST DOUBLE of the AWS Neuron SDK interfaces used by
:mod:`workers.backends.neuron` (the real ``torch-neuronx``/``neuronx-cc``/``neuronx-distributed`` come
from the Neuron package repository, need a Neuron-capable Linux image, and cannot be installed here). It
behaves as the SDK's documentation, release notes and public issues say, each behaviour citing its source
in a comment. It is never installed and never imported by production code; tests put it on the *child
process's* search paths with :func:`neuron_double_env`.

Environment (all read by the double in the child, none by our code):

``PYTHONPATH`` += ``tests/doubles/neuron``, ``PATH`` += ``tests/doubles/neuron/bin``
    ``import torch_neuronx`` / ``neuronxcc`` / ``neuronx_distributed`` and ``neuronx-cc`` resolve to the double.
``COMPILESVC_NEURON_SDK``
    the release the worker *claims* (our code reads it).
``COMPILESVC_NEURON_DOUBLE_RELEASE``
    the release whose packages are *installed* (default 2.27.1): version strings, code style (bare codes
    before 2.21), which NxD APIs exist. Versions per release: ``tests/doubles/neuron/_release.py``
    (``RELEASES``, from the SDK's release manifest). A package the release does not ship is not installed:
    for 2.32.0 (neuronx-cc alone, per the manifest) ``PYTHONPATH`` gets a site directory holding only
    ``neuronxcc`` (:func:`installed_site`), so ``torch_neuronx`` and ``neuronx_distributed`` are not
    importable; ``neuron_double_env(without=("torch_neuronx",))`` presents such a host for any release.
``COMPILESVC_NEURON_DOUBLE_DEVICES=N``
    simulate N Neuron devices (0: none); unset, real ``/dev/neuron*`` nodes decide.
``COMPILESVC_NEURON_DOUBLE_PLATFORM``
    the platform a host with devices detects (default trn1).
``NEURON_PLATFORM_TARGET_OVERRIDE``
    read once, when ``torch_neuronx`` is imported (later changes have no effect, as in the SDK).
``COMPILESVC_NEURON_DOUBLE_PMT_PORT``
    the port parallel_model_trace's rank 0 binds (real: 2022, hard-coded).

Behaviour is chosen per compile by a compiler flag in the request's ``args`` (``--double-behaviour=<b>``,
which the double's neuronx-cc accepts as an option) or for a whole process tree by
``COMPILESVC_NEURON_DOUBLE_BEHAVIOUR=<b>`` (the flag wins). Preconditions come first: trace on a host with
no device and ``cpu_backend=False`` raises the PJRT "num_devices > 0" RuntimeError; ``cpu_backend=True``
without ``--target`` (or with no platform frozen at import) raises the "If you want to compile on CPU,
please supply compiler argument target" RuntimeError; neuronx-cc rejects unknown options argparse-style
("unrecognized arguments", exit 2). Behaviours:

``ok`` (default)
    trace really traces with ``torch.jit.trace`` (the artifact loads and runs on CPU); neuronx-cc writes a
    deterministic fake NEFF recording ``target=`` (the compiler's), ``lowered_for=`` (trace's frozen
    platform), ``lnc=`` (the compile's logical NeuronCores: the option, else 2 on trn2/trn3 and 1 elsewhere)
    and, when ModelBuilder ran it, ``nxd_logical_nc_config=`` (the builder's, which laid out its process
    groups). Both print neuronx-cc-style log lines. The compiler takes the ``--target`` values of the
    emulated release only (trn2 from 2.21.0, trn3 from 2.29.0, per the manifest's instance families) and
    refuses LNC 2 off trn2/trn3 with ``NCC_EARG001`` (exit 70).
``ncc-error`` / ``ncc-error:NCC_EXXX000``
    exit 70 with ``[NCC_EOOM001] ...`` (default code); on releases before 2.21 the bare form ``[OOM001]``.
    trace raises ``RuntimeError("neuronx-cc failed with 70")``. Any family prints this way, e.g.
    ``ncc-error:NCC_CFG015`` (control flow graph validation, compiler release notes 2.29.0). A failure the
    release notes call non-deterministic (NCC_CFG… before 2.31.0) is emulated by setting
    ``COMPILESVC_NEURON_DOUBLE_BEHAVIOUR=ncc-error:NCC_CFG015`` for one attempt and unsetting it for the next,
    or, for a worker process whose environment is fixed, by ``COMPILESVC_NEURON_DOUBLE_RACE_FILE=<path>``: while
    that file exists (its directory bound read-only into the sandbox, ``COMPILESVC_SANDBOX_READ_PATHS``) the
    compiler fails with the code it holds; the test removes it. A compile sandbox keeps no state between
    attempts, so the double itself cannot count them.
``ncc-internal`` / ``ncc-internal:NCC_IXXX000``
    exit 70 with ``[INTERNAL_ERROR] [NCC_INLA001] ...`` (default code); before 2.21 ``[NLA001]  Unhandled ...``.
``bare-code`` / ``bare-code:XTP002``
    exit 70 with ``[XTP002] neuronx-cc terminated abnormally ...`` (old-style code, any release).
``unsupported-op``
    trace raises ``NotImplementedError("Could not run 'aten::_fft_r2c' with arguments from the 'XLA'
    backend ...")`` before any compiler runs (no code); neuronx-cc exits 70 with ``[NCC_EUOC002] An
    unsupported operator was used ...``.
``oom``
    the compiler is SIGKILLed (the OOM killer): neuronx-cc's status is -9, trace raises
    ``RuntimeError("neuronx-cc failed with -9")``.
``f137``
    neuronx-cc prints ``[F137] neuronx-cc was forcibly killed - This most commonly occurs due to insufficient
    system memory. …`` and exits 70 (the host's memory, as the driver reports it).
``crash`` / ``segfault``
    trace: the calling process (the compile child) kills itself with SIGKILL / SIGSEGV -> child
    returncode -9 / -11. neuronx-cc: the compiler kills itself -> status -9 / -11.
``slow:N``
    the compiler prints a progress line every 0.25 s for N seconds (float), then succeeds. For the
    runner's timeout and cancel tests: it runs as a grandchild in the child's process group.
``linger:group`` / ``linger:session``
    the compiler starts a process that sleeps 300 s (its command line names ``double-linger``) in its own
    process group or in a session of its own, then succeeds: for what a runner leaves behind.
``exit:N``
    the compiler prints the internal-error banner with no code and exits N: an unknown failure.
``missing-lib``
    the compiler fails like a binary missing ``libxml2.so.2`` ("error while loading shared libraries"),
    exit 127.
``corrupt-cache``
    ModelBuilder (2.23+) plants an unreadable ``compile_flags.json`` in this compile's cache entry, then
    fails reading it with the bare ``[NLA001] Unhandled exception with message:
    [json.exception.parse_error.101] …`` (aws-neuron-sdk neuron-framework-autoport.rst: "Delete the compiler
    cache … and retry"). With ``COMPILESVC_NEURON_DOUBLE_CORRUPT_CACHE_ONCE=<file>`` it plants only while the
    file does not exist, then creates it: a corruption met once across attempts (the file must be visible
    to the compile, so such tests run unsandboxed).

The host's trouble, not the model's (each row of workers/compiling/failure_table.py's table has a behaviour; sources in
the double's comments). neuronx-cc reports an exception its passes raise through the driver's wrapper:
the "An Internal Compiler Error has occurred" banner, ``[INTERNAL_ERROR] [NCC_INLA001] Unhandled exception
with message: <str(exception)>`` (``[NLA001]`` before 2.21), ``Type: <class '...'>``, exit 70. trace raises
the Python exception the real code path raises (a RuntimeError for neuronx-cc failing under it).

``disk-full``
    neuronx-cc: the wrapper around ``[Errno 28] No space left on device: '<output>'`` (OSError). trace:
    writing the HLO into ``compiler_workdir`` raises that OSError (ENOSPC) before the compiler runs.
``host-oom``
    neuronx-cc: the wrapper around ``std::bad_alloc`` (MemoryError, as Cython translates it). trace:
    lowering on the CPU raises torch's ``RuntimeError: [enforce fail at alloc_cpu.cpp:117] ...
    DefaultCPUAllocator: can't allocate memory ... (Cannot allocate memory)``. (A kernel OOM kill is ``oom``.)
``missing-module`` / ``missing-module:NAME``
    neuronx-cc: a half-installed SDK, the console script dies on import with a traceback ending in
    ``ModuleNotFoundError: No module named 'numpy'`` (default NAME), exit 1, before parsing anything.
    trace: ``RuntimeError("neuronx-cc is not installed. ...")`` chained from ``ModuleNotFoundError: No
    module named 'neuronxcc'`` (default NAME), before the compiler runs.
``host-os-error``
    neuronx-cc: the wrapper around ``[Errno 5] Input/output error: '<input>'`` (OSError). trace: creating
    its run directory under ``compiler_workdir`` raises ``PermissionError: [Errno 13] Permission denied``.

neuronx_distributed: ``parallel_model_trace`` runs one spawned process per rank (rank 0 binds the
rendezvous port; a second concurrent run fails with "Address already in use"), honours
``max_parallel_compilations`` (and prints what it got), needs a device, warns on 2.26 and raises from 2.27;
``trace.model_builder.ModelBuilder`` exists from 2.20 and traces from 2.21 (the one-process form;
``compiler_flag_hook`` from 2.26), in one process with no port; ``shard_checkpoint`` writes per-rank
``tp<rank>_sharded_checkpoint.safetensors`` files.
From 2.23 ModelBuilder compiles through the persistent compile cache (``neuron_xla_compile(use_cache=True,
cache_dir=None)``, neuronx-distributed commit e834945): the directory is ``--cache_dir`` in ``NEURON_CC_FLAGS``,
else ``NEURON_COMPILE_CACHE_URL``, else ``/var/tmp/neuron-compile-cache`` (neuron-caching.rst); entries are
keyed by the module and the flags, ``--logfile=<absolute path>`` included; a done entry is reused, a failed
one is not recompiled, a lock file marks a running compile.

neuronx_distributed_inference (NxD Inference, releases whose manifest ships it): ``NeuronConfig``/``InferenceConfig``,
``load_pretrained_config`` and the model classes compile a Hugging Face checkpoint directory into NxDI's layout
(``neuron_config.json``, ``model.pt``, ``weights/`` with pre-sharding); the knobs
``COMPILESVC_NEURON_DOUBLE_NXDI_SECONDS``, ``COMPILESVC_NEURON_DOUBLE_NXDI_MEMORY_MB``,
``COMPILESVC_NEURON_DOUBLE_NXDI_HOST_MEMORY_MB`` and ``COMPILESVC_NEURON_DOUBLE_NXDI_OOM`` (``f137`` | ``sigkill``)
make a compile take time or run out of host memory (see its ``models/_claims.py``).

torch_neuronx: ``trace(..., cpu_backend=...)`` exists from 2.21.0 (the keyword first appears in that release's
trace API reference, aws-neuron-sdk commit 752349fd); on 2.19/2.20 passing it is a TypeError and a host with no
device cannot trace (aws-neuron-sdk#910).

Runner tests: ``env = neuron_double_env(behaviour="slow:30")`` and start the child with it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

NEURON_DOUBLE_DIR = Path(__file__).resolve().parent / "neuron"
BEHAVIOUR_ENV = "COMPILESVC_NEURON_DOUBLE_BEHAVIOUR"
RELEASE_ENV = "COMPILESVC_NEURON_DOUBLE_RELEASE"
DEVICES_ENV = "COMPILESVC_NEURON_DOUBLE_DEVICES"
DEFAULT_SDK = "2.27.1"


def _prepend(path: str, existing: str | None) -> str:
    return path if not existing else path + os.pathsep + existing


def known_releases() -> tuple[str, ...]:
    """The releases the double can emulate (``RELEASES`` of ``tests/doubles/neuron/_release.py``)."""
    from tests.doubles.neuron._release import RELEASES  # a namespace package: importable, never on sys.path

    return tuple(RELEASES)


#: ``neuron_double_env(transformers=...)``'s default: the transformers version our table says the release's NxDI
#: compiles with (:mod:`compilesvc.spec.nxdi_transformers`).
RELEASE_TRANSFORMERS = "release"


def double_transformers(release: str, transformers: str | None = RELEASE_TRANSFORMERS) -> str | None:
    """The transformers version a host of the double at ``release`` presents (None: the venv's own)."""
    from compilesvc.spec.nxdi_transformers import transformers_for
    from tests.doubles.neuron._release import RELEASES

    if transformers != RELEASE_TRANSFORMERS:
        return transformers
    return transformers_for(RELEASES[release].nxdi)


def installed_metadata(release: str, transformers: str | None = None) -> Path:
    """A directory of pip ``*.dist-info`` records for the double's packages at ``release``'s versions.

    On a real host pip leaves these, and :mod:`importlib.metadata` (what workers read versions from)
    sees the distributions' full versions, e.g. neuronx-distributed ``0.16.25997`` where the package's own
    ``_version`` module says ``0.16.0``. Written once per release under the temp dir, atomically.

    ``transformers``: a version to record for transformers too (None: none, the venv's real one shows). The
    real transformers still runs: what NxDI reads config.json with is the venv's, and only the version the
    worker checks against our table (:func:`workers.host.versions.nxdi_unavailable`) is the release's, so
    the tests can present a host of every NxDI release without installing every transformers line.
    """
    from tests.doubles.neuron._release import RELEASES

    entry = RELEASES[release]
    # "v3": the records gained transformers; an older run's directory lacks it.
    root = (Path(tempfile.gettempdir()) / "compilesvc-neuron-double-metadata" / "v3"
            / (release if transformers is None else f"{release}-transformers-{transformers}"))
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{release}-"))
    staging.chmod(0o755)  # readable by every user, as pip leaves site-packages (compiles run as another user)
    for name, version in (("neuronx-cc", f"{entry.neuronx_cc}+{entry.build_hash}"),
                          ("torch-neuronx", entry.torch_neuronx and f"{entry.torch_neuronx}+{entry.build_hash}"),
                          ("neuronx-distributed", entry.neuronx_distributed),
                          ("neuronx-distributed-inference", entry.nxdi), ("transformers", transformers)):
        if not version:
            continue  # a package the release does not ship is not installed (2.32.0: no torch-neuronx)
        dist = staging / f"{name.replace('-', '_')}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    try:
        staging.rename(root)
    except OSError:  # another process published it first: theirs is identical
        for path in sorted(staging.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        staging.rmdir()
    return root


#: The double's top-level modules and the distributions that install them.
MODULE_DISTRIBUTIONS = {"neuronxcc": "neuronx-cc", "torch_neuronx": "torch-neuronx",
                        "neuronx_distributed": "neuronx-distributed",
                        "neuronx_distributed_inference": "neuronx-distributed-inference"}


def _double_digest(modules: tuple[str, ...]) -> str:
    """A digest of the double's files a site of ``modules`` copies: a changed double makes a new site."""
    digest = hashlib.sha256()
    for path in sorted([NEURON_DOUBLE_DIR / "_release.py",
                        *(f for m in modules for f in (NEURON_DOUBLE_DIR / m).rglob("*.py"))]):
        digest.update(str(path.relative_to(NEURON_DOUBLE_DIR)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def installed_site(release: str, modules: tuple[str, ...], transformers: str | None = None) -> Path:
    """A site directory holding only ``modules`` of the double and their ``*.dist-info``: a host where the
    others are not installed at all (``importlib.util.find_spec`` finds nothing), as on an SDK 2.32.0 host,
    which has neuronx-cc and no torch-neuronx. Copies, not links: a compile sandbox binds the PYTHONPATH
    entries it is given, not what links in them point to. Written once per content, atomically."""
    metadata = installed_metadata(release, transformers)
    root = (Path(tempfile.gettempdir()) / "compilesvc-neuron-double-site"
            / "-".join((_double_digest(modules), release, *sorted(modules), f"transformers{transformers or ''}")))
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{release}-"))
    staging.chmod(0o755)
    shutil.copy2(NEURON_DOUBLE_DIR / "_release.py", staging / "_release.py")
    ignore = shutil.ignore_patterns("__pycache__")
    for module in modules:
        shutil.copytree(NEURON_DOUBLE_DIR / module, staging / module, ignore=ignore)
        prefix = MODULE_DISTRIBUTIONS[module].replace("-", "_") + "-"
        for dist in metadata.glob(f"{prefix}*.dist-info"):
            shutil.copytree(dist, staging / dist.name)
    for dist in metadata.glob("transformers-*.dist-info"):
        shutil.copytree(dist, staging / dist.name)
    try:
        staging.rename(root)
    except OSError:  # another process published it first: theirs is identical
        shutil.rmtree(staging)
    return root


def neuron_double_env(base: Mapping[str, str] | None = None, *, behaviour: str | None = None,
                      sdk: str | None = DEFAULT_SDK, installed: str | None = None,
                      devices: int | None = None, without: tuple[str, ...] = (),
                      transformers: str | None = RELEASE_TRANSFORMERS) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) with the Neuron SDK double enabled (see the module doc).

    ``sdk``: the release the worker claims (``COMPILESVC_NEURON_SDK``; None: unset). ``installed``: the
    release the double emulates; default ``sdk`` when the double knows it, else the double's default (a
    claim such as "2.20" that is not a release still needs installed packages). ``devices``: simulated
    Neuron device count (None: leave it to the host's ``/dev/neuron*``). ``without``: modules of the double
    (``torch_neuronx``, ``neuronx_distributed``) left uninstalled, e.g. a host with neuronx-cc alone; a
    release that ships no such package (2.32.0: no torch-neuronx, no NxD) never has it. ``transformers``: the
    version the host presents (:func:`installed_metadata`); default the one our table fixes for the installed
    release's NxDI, None the venv's real one (a host whose transformers is not its NxDI's).
    """
    from tests.doubles.neuron._release import RELEASES

    env = dict(os.environ if base is None else base)
    if installed is None:
        installed = sdk if sdk in known_releases() else DEFAULT_SDK
    unknown = set(without) - set(MODULE_DISTRIBUTIONS)
    if unknown:
        raise ValueError(f"not modules of the Neuron double: {sorted(unknown)}")
    modules = tuple(m for m in RELEASES[installed].modules if m not in without)
    presented = double_transformers(installed, transformers)
    if modules == tuple(MODULE_DISTRIBUTIONS):  # the whole SDK: the double's own directory
        paths = os.pathsep.join([str(NEURON_DOUBLE_DIR), str(installed_metadata(installed, presented))])
    else:
        paths = str(installed_site(installed, modules, presented))
    env["PYTHONPATH"] = _prepend(paths, env.get("PYTHONPATH"))
    env["PATH"] = _prepend(str(NEURON_DOUBLE_DIR / "bin"), env.get("PATH"))
    if behaviour is not None:
        env[BEHAVIOUR_ENV] = behaviour
    if sdk is not None:
        env["COMPILESVC_NEURON_SDK"] = sdk
    env[RELEASE_ENV] = installed
    if devices is not None:
        env[DEVICES_ENV] = str(devices)
    return env


def with_devices(env: Mapping[str, str], root: Path, count: int) -> dict[str, str]:
    """``env`` on a host with ``count`` Neuron devices: device nodes under ``root / "dev"`` that our code
    finds (``COMPILESVC_NEURON_DEVICE_GLOB``), and the double's own simulated count."""
    nodes = root / "dev"
    nodes.mkdir(exist_ok=True)
    for index in range(count):
        (nodes / f"neuron{index}").touch()
    return {**env, "COMPILESVC_NEURON_DEVICE_GLOB": str(nodes / "neuron[0-9]*"), DEVICES_ENV: str(count)}
