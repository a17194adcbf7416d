"""TEST DOUBLE of ``torch_neuronx`` (AWS Neuron's PyTorch package). Not the real SDK.

A stand-in for tests, because the real torch-neuronx cannot be installed on the test hosts (see
tests/doubles/__init__.py for how to enable it and the behaviours). It mirrors the one interface the
compile child uses, :func:`trace`, with the real signature:

- it runs ``torch.jit.trace`` on the CPU, so the returned ScriptModule saves, loads and runs (there is
  no NEFF inside);
- like the real wrapper it writes an HLO file under ``compiler_workdir`` and runs the ``neuronx-cc``
  executable found on PATH (the double's script) as a subprocess sharing our stdout/stderr, raising
  ``RuntimeError("neuronx-cc failed with <status>")`` when it fails: codes are only in that output;
- ``crash`` / ``segfault`` behaviours kill the *calling* process instead.
"""

from __future__ import annotations

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

__version__ = "0.0.0+testdouble"
BEHAVIOUR_ENV = "COMPILESVC_NEURON_DOUBLE_BEHAVIOUR"
_BIN = Path(__file__).resolve().parent.parent / "bin" / "neuronx-cc"


def _say(message: str) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    print(f"{stamp}:  {os.getpid()}  INFO ||NEURON_CC_WRAPPER||: {message}", flush=True)


def _behaviour(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg.startswith("--double-behaviour="):
            return arg.partition("=")[2]
        if arg == "--double-behaviour" and i + 1 < len(args):
            return args[i + 1]
    return os.environ.get(BEHAVIOUR_ENV) or "ok"


def trace(func: Any, example_inputs: Any, *_: Any, input_output_aliases: dict[Any, Any] | None = None,
          compiler_workdir: str | os.PathLike[str] | None = None, compiler_args: str | list[str] | None = None,
          partitioner_config: Any = None, inline_weights_to_neff: bool = True, cpu_backend: bool = False) -> Any:
    """Trace ``func`` at ``example_inputs`` (TEST DOUBLE: CPU TorchScript, compiler run is simulated)."""
    import torch

    args = shlex.split(compiler_args) if isinstance(compiler_args, str) else list(compiler_args or [])
    behaviour = _behaviour(args)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    workdir = Path(compiler_workdir) if compiler_workdir else Path.cwd() / "neuron-compiler-workdir"
    run_dir = workdir / str(uuid.uuid4())
    run_dir.mkdir(parents=True, exist_ok=True)

    _say(f"torch_neuronx TEST DOUBLE {__version__}; NEURON_CC_FLAGS={os.environ.get('NEURON_CC_FLAGS', '')!r}")
    with torch.no_grad():
        traced = torch.jit.trace(func, inputs)
    hlo = run_dir / "model.hlo_module.pb"
    hlo.write_text(str(traced.inlined_graph) if hasattr(traced, "inlined_graph") else repr(traced))
    neff = run_dir / "graph.neff"
    compiler = shutil.which("neuronx-cc") or str(_BIN)
    command = [compiler, "compile", "--framework=XLA", str(hlo), "--output", str(neff), *args]
    _say("Call compiler with cmd: " + " ".join(command))

    if behaviour in ("crash", "segfault"):
        _say("Compiling (the double now kills this process, as an OOM kill or a segfault would)")
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL if behaviour == "crash" else signal.SIGSEGV)
        time.sleep(10)

    sys.stdout.flush()
    sys.stderr.flush()
    status = subprocess.run(command, cwd=run_dir, check=False).returncode
    if status != 0:
        raise RuntimeError(f"neuronx-cc failed with {status}")
    _say(f"Compiled {neff}; inline_weights_to_neff={inline_weights_to_neff}")
    return traced
