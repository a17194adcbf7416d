"""The Neuron targets' backends (inf2, trn1, trn2, trn3), for hosts with the AWS Neuron SDK installed.

Owns how a compile request becomes a ``torch_neuronx.trace`` call or a ``neuronx-cc compile`` command, how
the compiler's output is passed through and read for its error codes, and which versions are recorded.

- ``trace`` (torchscript / exported-program / hf-dir models): ``torch_neuronx.trace(model, example_inputs,
  compiler_workdir=<work_dir>/neuron, compiler_args=<args> + ["--target", <target>])``, saved with
  ``torch.jit.save`` as ``model.pt`` (a TorchScript module with the NEFF inside). ``tp_degree > 1`` goes
  through neuronx-distributed: its ``ModelBuilder`` where the installed release has the one-process form,
  ``parallel_model_trace`` on older ones (:mod:`workers.backends.neuron_parallel`, which also owns the
  rendezvous port and the bound on ranks compiling at once). Only models built from neuronx-distributed's
  parallel layers are actually sharded; others are replicated per rank.
- ``neuronx-cc`` (hlo models): ``neuronx-cc compile <model> --framework XLA --target <target> --output
  <out_dir>/model.neff <args>`` run as a subprocess in ``<work_dir>/neuron`` with its output streamed through.
  neuronx-cc has no tensor-parallel option: an HLO module is one rank's program, so ``tp_degree`` changes
  nothing in the command (it is in the key, and logged).

Logical NeuronCores: the request's ``lnc`` (resolved at submit into the key, ``toolchain.lnc``: the spec's
``--logical-nc-config``, else the target's default, 2 on trn2/trn3) is given to the compiler as
``--logical-nc-config=<lnc>`` on trn2/trn3 (the only targets with the option: CLI reference, EARG001) on every
path, and to ModelBuilder as ``logical_nc_config`` (:mod:`workers.backends.neuron_parallel`), so NxD's replica
groups and the compiled program agree (ModelBuilder's own default is 1, the compiler's 2 on trn2).

Hosts without a Neuron device (compiling needs the SDK, not the chip): :func:`neuron_devices` looks for
``/dev/neuron*``; with none, trace gets ``cpu_backend=True`` and ``--target <target>`` in its compiler args
(trace API reference; optimum-neuron PR #961), otherwise it fails in the PJRT client ("num_devices > 0",
aws-neuron-sdk#902/#910). ``cpu_backend`` exists from SDK 2.21.0 (the keyword first appears in that release's
trace API reference, aws-neuron-sdk commit 752349fd): for older releases it is never passed (it would be a
TypeError), and their trace compiles run only on hosts with a device, which routing sees to
(:func:`compilesvc.spec.neuron_kinds.device_requirement`); one that arrives anyway is
``NEURON_DEVICE_REQUIRED``. ``NEURON_PLATFORM_TARGET_OVERRIDE`` is read once, when the Neuron libraries are
imported (optimum-neuron #961/#988), so the runner puts the request's target in the compile child's
environment at process start (:func:`workers.isolation.child_env.child_environment_for`); the child checks it
before importing torch_neuronx and refuses a disagreeing value.

``NEURON_CC_FLAGS`` is read by the torch-neuronx wrapper, not by the ``neuronx-cc`` CLI. The persistent
compile cache it and ``NEURON_COMPILE_CACHE_URL`` configure is used by NxD's ModelBuilder since SDK 2.23
(tp > 1); each trace compile gets its own, empty, in its work directory (:mod:`workers.backends.neuron_cache`).
For ``trace`` the child refuses a ``NEURON_CC_FLAGS`` carrying flags that change compiler output (they would
change artifacts without changing keys). ``COMPILESVC_NEURON_SDK`` (see :mod:`workers.host.versions`), when
set, must match the request's sdk.

Nothing here imports torch or the SDK at module level: the hlo path needs neither.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from compilesvc.spec.neuron_kinds import device_requirement, trace_has_cpu_backend
from compilesvc.spec.neuron_toolchain import toolchain_differences
from compilesvc.spec.neuronx_cc_options import LNC_OPTION, LNC_TARGETS, effective_lnc
from workers.backends.neuron_cache import discard_compile_cache, own_compile_cache
from workers.backends.output_tee import TAIL_LINES, OutputTee
from workers.compiling.classify import judge
from workers.compiling.contract import (
    ArtifactFile,
    Backend,
    CompileRequest,
    CompileResult,
    InfraError,
    failure_for,
    log,
)
from workers.compiling.failure_table import CORRUPT_CACHE_ROW, Evidence
from workers.compiling.failure_text import traceback_exception
from workers.host.versions import (
    NEURON_SDK_ENV,
    installed_toolchain_differences,
    module_version,
    neuron_manifest_versions,
    neuronx_cc_executable,
    neuronx_cc_version,
    python_version,
    torch_neuronx_version,
)
from workers.isolation.child_env import NEURON_CC_FLAGS, PLATFORM_OVERRIDE_ENV, output_changing_problems

#: The compiler's own log file (neuronx-cc writes it in its working directory).
COMPILER_LOG_NAME = "log-neuron-cc.txt"
#: Neuron device nodes (the driver creates /dev/neuron0 … per device).
DEVICE_GLOB = "/dev/neuron[0-9]*"
DEVICE_GLOB_ENV = "COMPILESVC_NEURON_DEVICE_GLOB"

_EXIT_STATUS_RE = re.compile(r"(?:failed with|exit(?:ed)?(?: with)?(?: status| code)?)\s*:?\s*(-?\d+)", re.IGNORECASE)


def _check_sdk(request: CompileRequest) -> str | None:
    """The host's Neuron SDK release if configured. Another release is fine when it ships the same toolchain
    for this compile (keys, and so queues, are shared by such releases: compilesvc.dispatch.routing); a different
    toolchain means a misrouted request."""
    host = os.environ.get(NEURON_SDK_ENV, "").strip() or None
    if host is None:
        log(f"{NEURON_SDK_ENV} is not set: cannot check that this host has Neuron SDK {request.sdk}")
        return None
    if host != request.sdk:
        try:
            differences = toolchain_differences(request.sdk, host, request.backend, request.tp_degree)
        except ValueError as exc:  # a release this worker's table does not know
            differences = [str(exc)]
        if differences:
            raise InfraError("WRONG_SDK", f"this host has Neuron SDK {host}, the request needs {request.sdk}: "
                             + "; ".join(differences))
        log(f"request for Neuron SDK {request.sdk} runs on {host}: the same toolchain for this compile")
    _check_installed_toolchain(request)
    return host


def _check_installed_toolchain(request: CompileRequest) -> None:
    """The packages this child imports must be the ones the key names: the worker checked them at start,
    but an SDK upgraded under a running worker would otherwise publish under the old toolchain's key."""
    try:
        differences = installed_toolchain_differences(request.sdk, request.backend, request.tp_degree)
    except ValueError as exc:  # a release this worker's table does not know
        raise InfraError("WRONG_SDK", str(exc)) from None
    if differences:
        raise InfraError("TOOLCHAIN_MISMATCH", f"this worker's packages are not Neuron SDK {request.sdk}'s "
                         f"(upgraded since the worker started? restart it): " + "; ".join(differences))


def check_neuron_cc_flags(for_trace: bool) -> None:
    """Log NEURON_CC_FLAGS; for trace (where the wrapper reads it), refuse flags that change output."""
    raw = os.environ.get(NEURON_CC_FLAGS, "")
    log(f"{NEURON_CC_FLAGS}={raw!r}")
    if not for_trace:
        return  # only torch_neuronx reads it; the hlo path runs neuronx-cc itself
    # The worker refused to start with such flags; this guards a child started some other way.
    problems = output_changing_problems({NEURON_CC_FLAGS: raw})
    if problems:
        raise InfraError("WORKER_MISCONFIGURED", "; ".join(problems))


def neuron_devices() -> list[str]:
    """This host's Neuron device nodes (``/dev/neuron0`` …): where there are none, trace runs on the CPU
    backend. ``COMPILESVC_NEURON_DEVICE_GLOB`` replaces the pattern (docs/neuron-hosts.md, settings: a
    container that maps the device nodes elsewhere; the tests simulate hosts with it)."""
    return sorted(glob.glob(os.environ.get(DEVICE_GLOB_ENV) or DEVICE_GLOB))


def freeze_platform_target(target: str) -> None:
    """Make sure the Neuron libraries will see (or saw) ``target`` as the platform when they are imported."""
    current = os.environ.get(PLATFORM_OVERRIDE_ENV)
    if current == target:
        return
    if "torch_neuronx" in sys.modules or "libneuronxla" in sys.modules:
        raise InfraError("WORKER_MISCONFIGURED", f"{PLATFORM_OVERRIDE_ENV}={current!r} when the Neuron libraries "
                                                 f"were imported; this compile needs {target!r} (the value is "
                                                 f"read once, at import)")
    if current:
        log(f"{PLATFORM_OVERRIDE_ENV}={current!r} in this child's environment, but the request's target is "
            f"{target}: using {target}")
    os.environ[PLATFORM_OVERRIDE_ENV] = target  # before any Neuron import in this process


def request_lnc(request: CompileRequest) -> int:
    """The logical NeuronCores of ``request``: resolved at submit (``lnc``), or for a request of an older key
    (no ``lnc``) from its flags the same way (its --logical-nc-config, else the target's default)."""
    if request.lnc is not None:
        return request.lnc
    return effective_lnc(request.target, list(request.args))[0]


def _compiler_args(request: CompileRequest) -> list[str]:
    """The request's flags without any --target (the request's target is the one in the key), and with the
    request's logical NeuronCores where the target has them (:func:`request_lnc`), once."""
    args = []
    for arg in request.args:
        name, _, value = arg.partition("=")
        if name == "--target":
            if value and value != request.target:
                log(f"ignoring {arg} in compiler args: the request's target is {request.target}")
            continue
        if name == LNC_OPTION:
            continue  # an older key's spelling: request_lnc read it; it is given once, below
        args.append(arg)
    if request.target in LNC_TARGETS:
        args.append(f"{LNC_OPTION}={request_lnc(request)}")
    return args


def read_compiler_logs(directory: Path, limit: int = TAIL_LINES) -> list[str]:
    """The last lines of every neuronx-cc log file under ``directory`` (a fallback source of codes)."""
    lines: list[str] = []
    if directory.is_dir():
        for path in sorted(directory.rglob(COMPILER_LOG_NAME)):
            with contextlib.suppress(OSError):
                lines.extend(path.read_text(errors="replace").splitlines()[-limit:])
    return lines


def raise_for_trace_failure(exc: BaseException, lines: Sequence[str]) -> NoReturn:
    """Turn a failed torch_neuronx trace into the failure :data:`workers.compiling.failure_table.TABLE` finds for it.

    The exception's type and message are evidence too (an operator torch-xla cannot lower raises during
    trace, with no code); the exit status comes from the exception (``neuronx-cc failed with -9``).
    """
    status = getattr(exc, "returncode", None)
    if not isinstance(status, int):
        match = _EXIT_STATUS_RE.search(str(exc))
        status = int(match.group(1)) if match else None
    names = tuple(cls.__name__ for cls in type(exc).__mro__)
    if "ProcessRaisedException" in names:
        # torch.multiprocessing.spawn (NxD's per-rank processes) wraps a rank's exception in its traceback
        # text ("-- Process 1 terminated with the following error: Traceback ... NotImplementedError: ...",
        # torch/multiprocessing/spawn.py): the rank's own exception is the evidence.
        names = traceback_exception(str(exc).splitlines()) or names
    exit_code = getattr(exc, "exit_code", None)
    if status is None and isinstance(exit_code, int) and "ProcessExitedException" in names:
        status = exit_code  # a rank that died (negative: by that signal), e.g. the OOM killer's SIGKILL
    # A traceback prints the exceptions an exception was raised from; so does the evidence. torch_neuronx's
    # hlo_compile re-raises a failed `import neuronxcc` as RuntimeError("neuronx-cc is not installed")
    # (huggingface/optimum-neuron#68): the ModuleNotFoundError behind it is what says "host".
    causes: list[str] = []
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cause is not None and len(causes) < 5:
        causes.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    evidence = Evidence([*lines, *reversed(causes), f"{type(exc).__name__}: {exc}"], status, exception=names,
                        who="torch_neuronx.trace" if status is None else "neuronx-cc (under torch_neuronx.trace)",
                        unknown_code="NEURON_TRACE_FAILED" if status is None else f"NEURONX_CC_EXIT_{status}")
    verdict = judge(evidence)
    if verdict.row == CORRUPT_CACHE_ROW:
        discard_compile_cache()
    raise failure_for(verdict.error_class, verdict.code, verdict.message) from exc


class TraceBackend(Backend):
    """``torch_neuronx.trace`` (neuronx-distributed for tp_degree > 1, see :mod:`workers.backends.neuron_parallel`)."""

    name = "trace"

    def compile(self, request: CompileRequest) -> CompileResult:
        host_sdk = _check_sdk(request)
        check_neuron_cc_flags(for_trace=True)
        freeze_platform_target(request.target)
        own_compile_cache(request.work_dir)
        try:
            import torch
            import torch_neuronx
        except ImportError as exc:
            raise InfraError("NEURON_SDK_MISSING", f"torch-neuronx is not importable on this worker: {exc}") from exc
        from workers.compiling.model_loading import example_inputs, load_model, order_inputs, run_forward

        t0 = time.monotonic()
        model = load_model(request.model_path, request.model_format, request.work_dir,
                           [i.name for i in request.inputs], request.extract_limits)
        ordered = order_inputs(model, request.inputs)
        tensors = tuple(example_inputs(ordered))
        log(f"loaded {request.model_format} model in {time.monotonic() - t0:.2f} s; inputs "
            + ", ".join(f"{d.name}:{d.dtype}{list(d.shape)}" for d in ordered))
        # A model that cannot run at these shapes fails here, deterministically, before the SDK is involved.
        run_forward(model, tensors, "NEURON_TRACE_ERROR")

        workdir = request.work_dir / "neuron"
        workdir.mkdir(parents=True, exist_ok=True)
        args = [*_compiler_args(request), "--target", request.target]
        devices = neuron_devices()
        cpu_backend = not devices  # no device: the PJRT client cannot start, trace must lower on the CPU
        # The keyword exists from SDK 2.21.0 (a TypeError before); such releases need a device instead.
        has_cpu_backend = trace_has_cpu_backend(request.sdk)
        trace_options = {"cpu_backend": cpu_backend} if has_cpu_backend else {}
        log(f"torch_neuronx.trace compiler_workdir={workdir} compiler_args={args} tp_degree={request.tp_degree} "
            f"cpu_backend={cpu_backend if has_cpu_backend else '(not in this release)'} devices={len(devices)} "
            f"{PLATFORM_OVERRIDE_ENV}={os.environ.get(PLATFORM_OVERRIDE_ENV)}")

        t0 = time.monotonic()
        files: list[ArtifactFile]
        parallel_versions: dict[str, str] = {}
        tee = OutputTee()
        if request.tp_degree == 1:
            needs_device = device_requirement(request.sdk, request.backend, request.tp_degree)
            if needs_device and not devices:
                # Routing keeps these off device-less hosts (workers.host.versions): this one was misrouted.
                raise InfraError("NEURON_DEVICE_REQUIRED", f"{needs_device}; this host has none (no /dev/neuron*)")
            try:
                with tee:
                    traced = torch_neuronx.trace(model, tensors, compiler_workdir=str(workdir),
                                                 compiler_args=args, **trace_options)
            except Exception as exc:
                raise_for_trace_failure(exc, [*tee.lines, *str(exc).splitlines(), *read_compiler_logs(workdir)])
            torch.jit.save(traced, str(request.out_dir / "model.pt"))
            files = [ArtifactFile("model.pt", "model")]
        else:
            from workers.backends.neuron_parallel import parallel_trace  # imports this module

            files, parallel_versions = parallel_trace(request, model, tensors, workdir, args, tee, devices)
        log(f"traced and compiled in {time.monotonic() - t0:.2f} s")

        versions = {
            "torch": torch.__version__,
            "torch_neuronx": str(getattr(torch_neuronx, "__version__", torch_neuronx_version() or "unknown")),
            "neuronx_cc": module_version("neuronxcc") or neuronx_cc_version() or "unknown",
            "python": python_version(),
            "target": request.target,
            # Where the graph was lowered. The key assumes the NEFF depends on --target alone; whether a
            # device host's lowering and cpu_backend's give identical NEFFs is not documented, so the
            # manifest says which ran (a serving host can tell the two apart if they ever differ).
            "trace_lowering": "cpu_backend" if cpu_backend else "device",
            **neuron_manifest_versions(host_sdk, trace=True),
        }
        versions.update(parallel_versions)
        return CompileResult(files=files, versions=versions)


class NeuronxCcBackend(Backend):
    """``neuronx-cc compile`` of an HLO module into ``model.neff``."""

    name = "neuronx-cc"

    def compile(self, request: CompileRequest) -> CompileResult:
        host_sdk = _check_sdk(request)
        check_neuron_cc_flags(for_trace=False)
        executable = neuronx_cc_executable()
        if executable is None:
            raise InfraError("NEURONX_CC_MISSING", "neuronx-cc is not on this worker's PATH")
        workdir = request.work_dir / "neuron"
        workdir.mkdir(parents=True, exist_ok=True)
        out = request.out_dir / "model.neff"
        command = [executable, "compile", str(request.model_path), "--framework", "XLA", "--target",
                   request.target, "--output", str(out), *_compiler_args(request)]
        if request.tp_degree > 1:
            log(f"tp_degree {request.tp_degree}: neuronx-cc compiles the HLO module as given (one rank's program)")
        log("running: " + shlex.join(command))

        t0 = time.monotonic()
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        # Same process group as the child (no new session): the runner's group kill reaches the compiler.
        with subprocess.Popen(command, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as proc:
            assert proc.stdout is not None
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace")
                sys.stdout.write(line)
                sys.stdout.flush()
                tail.append(line.rstrip("\n"))
            returncode = proc.wait()
        seconds = time.monotonic() - t0

        if returncode == 0:
            if not out.is_file():
                raise InfraError("NO_OUTPUT", f"neuronx-cc exited 0 but wrote no {out.name}")
            log(f"neuronx-cc finished in {seconds:.2f} s")
            versions = {"neuronx_cc": neuronx_cc_version(executable) or "unknown", "python": python_version(),
                        "target": request.target, **neuron_manifest_versions(host_sdk, trace=False)}
            return CompileResult(files=[ArtifactFile("model.neff", "model")], versions=versions)

        verdict = judge(Evidence([*tail, *read_compiler_logs(workdir)], returncode,
                                 unknown_code=f"NEURONX_CC_EXIT_{returncode}"))
        raise failure_for(verdict.error_class, verdict.code, verdict.message)

