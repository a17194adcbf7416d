"""TEST DOUBLE of ``torch_neuronx`` (AWS Neuron's PyTorch package). Not the real SDK.

A stand-in for tests, because the real torch-neuronx cannot be installed on the test hosts (see
tests/doubles/__init__.py for how to enable it and the behaviours). It mirrors :func:`trace` with the real
signature (trace API reference: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/
torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.html) and the real preconditions:

- the platform target is decided once, at import (NEURON_PLATFORM_TARGET_OVERRIDE, else the host's own
  when it has a Neuron device): setting the variable after ``import torch_neuronx`` changes nothing
  (optimum-neuron PR #961: "set the platform target before importing NeuronX libraries"; #988);
- with no Neuron device and ``cpu_backend=False`` trace fails in the PJRT client (aws-neuron-sdk#902,
  #910: "a Neuron device is currently required for torch 2.x compilation");
- ``cpu_backend`` exists from the 2.21.0 release (it first appears in that release's trace API reference,
  aws-neuron-sdk commit 752349fd): on 2.19/2.20 the keyword is a TypeError and only a host with a device
  can trace;
- ``cpu_backend=True`` needs ``--target`` in ``compiler_args`` and a known platform (optimum-neuron #961);
- an operator torch-xla cannot lower raises a Python exception during trace, with no compiler code;
- otherwise it runs ``torch.jit.trace`` on the CPU (the ScriptModule saves, loads and runs; there is no
  NEFF inside), writes an HLO file under ``compiler_workdir`` and runs the ``neuronx-cc`` found on PATH
  as a subprocess sharing our stdout/stderr, raising ``RuntimeError("neuronx-cc failed with <status>")``
  when it fails: codes are only in that output. ``crash``/``segfault`` kill the *calling* process.
- the host's trouble surfaces as the Python exception the real code path would raise: ``disk-full``,
  ``host-os-error``, ``host-oom``, ``missing-module`` (see :func:`_host_trouble`).
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _release import CPU_BACKEND_SINCE, behaviour_from, current, detected_platform, device_count, targets

_RELEASE = current()
if _RELEASE.torch_neuronx is None:  # neuron_double_env leaves the package off the path for such a release
    raise ImportError(f"Neuron TEST DOUBLE: SDK {_RELEASE.release} ships no torch-neuronx (test bug: the "
                      f"double's torch_neuronx is on the path)")
# pip's version of torch-neuronx: "2.9.0.2.13.24727+8e870898" (aws-neuron-sdk#1314).
__version__ = f"{_RELEASE.torch_neuronx}+{_RELEASE.build_hash}"
_BIN = Path(__file__).resolve().parent.parent / "bin" / "neuronx-cc"
#: Frozen here, once: what the SDK's platform detection saw when this module was imported.
PLATFORM_TARGET: str | None = detected_platform()

#: aws-neuron-sdk#902/#910: what trace raises on a host with no Neuron device.
NO_DEVICE_ERROR = ("Bad StatusOr access: INVALID_ARGUMENT: PJRT_Client_Create: error condition nullptr != "
                   "(args)->client->Error(): Init: error condition !(num_devices > 0): ")
#: optimum-neuron PR #961: cpu_backend without a target the libraries can use.
CPU_TARGET_ERROR = ("If you want to compile on CPU, please supply compiler argument target, with one of "
                    "options trn1, inf2, trn1n, or trn2. Ex: \"--target trn1\"")
#: The dispatcher's message for an op with no XLA kernel (pytorch/xla#9725).
#: torch's CPU allocator out of host memory (c10/core/impl/alloc_cpu.cpp; the text as users report it, e.g.
#: "RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory:
#: you tried to allocate 2359296 bytes. Error code 12 (Cannot allocate memory)").
HOST_OOM_ERROR = ("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
#: torch_neuronx's hlo_compile when neuronxcc cannot be imported (its source as quoted in
#: huggingface/optimum-neuron#68: ``import neuronxcc`` in a try, re-raised as this RuntimeError from the
#: ImportError): torch-neuronx installed without (or with a broken) neuronx-cc.
COMPILER_MISSING_ERROR = ("neuronx-cc is not installed.\nneuronx-cc can be installed using:\npython3 -m pip install "
                          "--extra-index-url=https://pip.repos.neuron.amazonaws.com neuronx-cc")
UNSUPPORTED_OP_ERROR = ("Could not run 'aten::_fft_r2c' with arguments from the 'XLA' backend. This could be "
                        "because the operator doesn't exist for this backend, or was omitted during the "
                        "selective/custom build process (if using custom build).")


def _say(message: str) -> None:
    # The wrapper's line shape: "2024-04-12 07:13:06.000297:  271334  INFO ||NEURON_CC_WRAPPER||: ..." (#872).
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    print(f"{stamp}:  {os.getpid()}  INFO ||NEURON_CC_WRAPPER||: {message}", flush=True)


def _target_arg(args: list[str]) -> str | None:
    """The right-most --target in ``args`` (argparse semantics), either spelling."""
    found = None
    for i, arg in enumerate(args):
        if arg.startswith("--target="):
            found = arg.partition("=")[2]
        elif arg == "--target" and i + 1 < len(args):
            found = args[i + 1]
    return found


def _check_preconditions(args: list[str], cpu_backend: bool) -> str:
    """The platform the HLO is lowered for, or the error the real SDK raises."""
    if not cpu_backend:
        if device_count() == 0:
            raise RuntimeError(NO_DEVICE_ERROR)
        assert PLATFORM_TARGET is not None  # a device means a detected platform
        return PLATFORM_TARGET
    target = _target_arg(args)
    if target not in targets(_RELEASE) or PLATFORM_TARGET is None:
        # No usable --target, or nothing frozen at import to lower for (#961: the override must be set
        # before the import). Which one the real SDK checks first is unverified; both fail the same way.
        raise RuntimeError(CPU_TARGET_ERROR)
    return PLATFORM_TARGET


def _trace_entry(func: Any, example_inputs: Any, compiler_workdir: str | os.PathLike[str] | None,
                 compiler_args: str | list[str] | None, inline_weights_to_neff: bool, cpu_backend: bool) -> Any:
    args = shlex.split(compiler_args) if isinstance(compiler_args, str) else list(compiler_args or [])
    _say(f"torch_neuronx TEST DOUBLE {__version__} (SDK {_RELEASE.release}); platform target frozen at "
         f"import: {PLATFORM_TARGET}; cpu_backend={cpu_backend}; "
         f"NEURON_CC_FLAGS={os.environ.get('NEURON_CC_FLAGS', '')!r}")
    lowered_for = _check_preconditions(args, cpu_backend)
    return _trace(func, example_inputs, compiler_workdir, args, lowered_for, inline_weights_to_neff)


if _RELEASE.tuple >= CPU_BACKEND_SINCE:
    def trace(func: Any, example_inputs: Any, *_: Any, input_output_aliases: dict[Any, Any] | None = None,
              compiler_workdir: str | os.PathLike[str] | None = None, compiler_args: str | list[str] | None = None,
              partitioner_config: Any = None, inline_weights_to_neff: bool = True, cpu_backend: bool = False) -> Any:
        """Trace ``func`` at ``example_inputs`` (TEST DOUBLE: CPU TorchScript, compiler run is simulated)."""
        return _trace_entry(func, example_inputs, compiler_workdir, compiler_args, inline_weights_to_neff,
                            cpu_backend)
else:
    # The signature before the 2.21.0 trace API reference (aws-neuron-sdk commit 752349fd's parent): no
    # cpu_backend keyword, so passing it is Python's own TypeError ("trace() got an unexpected keyword
    # argument 'cpu_backend'"), and a device-less host cannot trace at all (aws-neuron-sdk#910).
    def trace(func: Any, example_inputs: Any, *_: Any,  # type: ignore[misc]
              input_output_aliases: dict[Any, Any] | None = None,
              compiler_workdir: str | os.PathLike[str] | None = None, compiler_args: str | list[str] | None = None,
              partitioner_config: Any = None, inline_weights_to_neff: bool = True) -> Any:
        """Trace ``func`` at ``example_inputs`` (TEST DOUBLE: CPU TorchScript, compiler run is simulated)."""
        return _trace_entry(func, example_inputs, compiler_workdir, compiler_args, inline_weights_to_neff, False)


def _host_trouble(behaviour: str, where: Path, stage: str) -> None:
    """Raise what the real trace raises at ``stage`` when the host, not the model, is at fault.

    ``workdir``: creating ``compiler_workdir`` on a directory the worker may not write (host-os-error:
    PermissionError EACCES, "[Errno 13] Permission denied: '<path>'"). ``lowering``: tracing on the CPU runs
    out of host memory (host-oom: torch's allocator RuntimeError above). ``write``: the HLO module is
    written into ``compiler_workdir`` before neuronx-cc runs (the trace API reference: "compiler_workdir: the
    directory to save any compiler outputs to"); a full disk fails it with ENOSPC (disk-full). ``compile``:
    hlo_compile imports neuronxcc first (missing-module: the RuntimeError above, chained from the
    ModuleNotFoundError, as optimum-neuron#68 shows).
    """
    if stage == "workdir" and behaviour == "host-os-error":
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))
    if stage == "lowering" and behaviour == "host-oom":
        raise RuntimeError(HOST_OOM_ERROR)
    if stage == "write" and behaviour == "disk-full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    if stage == "compile" and behaviour.startswith("missing-module"):
        name = behaviour.split(":", 1)[1] if ":" in behaviour else "neuronxcc"
        try:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        except ImportError as exc:
            raise RuntimeError(COMPILER_MISSING_ERROR) from exc


def _trace(func: Any, example_inputs: Any, compiler_workdir: str | os.PathLike[str] | None, args: list[str],
           lowered_for: str, inline_weights_to_neff: bool = True, compile_neff: bool = True,
           compiler_env: dict[str, str] | None = None) -> Any:
    """Lower (CPU TorchScript) and compile (the neuronx-cc on PATH); shared with the NxD double, which passes
    ``compile_neff=False`` when its compile cache already holds the NEFF, and what the compiler's environment
    adds (``compiler_env``)."""
    import torch

    behaviour = behaviour_from(args)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    workdir = (Path(compiler_workdir) if compiler_workdir else Path("neuron-compiler-workdir")).resolve()
    run_dir = workdir / str(uuid.uuid4())
    _host_trouble(behaviour, run_dir, "workdir")
    run_dir.mkdir(parents=True, exist_ok=True)

    if behaviour == "unsupported-op":
        # torch-xla fails while lowering, before any compiler runs: a Python exception, no NCC code.
        raise NotImplementedError(UNSUPPORTED_OP_ERROR)
    _host_trouble(behaviour, run_dir, "lowering")
    with torch.no_grad():
        traced = torch.jit.trace(func, inputs)
    hlo = run_dir / "model.hlo_module.pb"
    _host_trouble(behaviour, hlo, "write")
    hlo.write_text(str(traced.inlined_graph) if hasattr(traced, "inlined_graph") else repr(traced))
    neff = run_dir / "graph.neff"
    if not compile_neff:
        return traced
    _host_trouble(behaviour, run_dir, "compile")
    compiler = shutil.which("neuronx-cc") or str(_BIN)
    # The wrapper puts its own --target (the frozen platform) first, the caller's args after (#872's
    # command line); the compiler's argparse keeps the right-most --target.
    command = [compiler, "compile", f"--target={lowered_for}", "--framework=XLA", str(hlo), "--output",
               str(neff), *args]
    _say("Call compiler with cmd: " + " ".join(command))

    if behaviour in ("crash", "segfault"):
        _say("Compiling (the double now kills this process, as an OOM kill or a segfault would)")
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL if behaviour == "crash" else signal.SIGSEGV)
        time.sleep(10)

    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "COMPILESVC_NEURON_DOUBLE_LOWERED_FOR": lowered_for, **(compiler_env or {})}
    status = subprocess.run(command, cwd=run_dir, env=env, check=False).returncode
    if status != 0:
        raise RuntimeError(f"neuronx-cc failed with {status}")
    _say(f"Compiled {neff} (HLO lowered for {lowered_for}); inline_weights_to_neff={inline_weights_to_neff}")
    return traced
