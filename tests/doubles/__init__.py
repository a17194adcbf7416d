"""Test doubles: stand-ins for software that cannot be installed on the test hosts.

``tests/doubles/neuron/`` is a TEST DOUBLE of the AWS Neuron SDK's interfaces used by
:mod:`workers.backends.neuron` (the real ``torch-neuronx``/``neuronx-cc`` come from the Neuron package
repository, need a Neuron-capable Linux image, and cannot be installed here). It is never installed
and never imported by production code; tests put it on the *child process's* search paths:

- ``PYTHONPATH`` += ``tests/doubles/neuron`` -> ``import torch_neuronx``, ``import neuronxcc``,
  ``import neuronx_distributed`` resolve to the doubles;
- ``PATH`` += ``tests/doubles/neuron/bin`` -> ``neuronx-cc`` resolves to the double's script;
- ``COMPILESVC_NEURON_SDK=2.20.0`` (any release; the child checks requests against it).

:func:`neuron_double_env` builds that environment. Behaviour is chosen per compile by a compiler flag in
the request's ``args`` (``--double-behaviour=<b>``, passed through as real compiler flags are) or for a
whole process tree by ``COMPILESVC_NEURON_DOUBLE_BEHAVIOUR=<b>`` (the flag wins). Behaviours:

``ok`` (default)
    trace really traces with ``torch.jit.trace`` (the artifact loads and runs on CPU); neuronx-cc
    writes a deterministic fake NEFF. Both print neuronx-cc-style log lines.
``ncc-error`` / ``ncc-error:NCC_EXXX123``
    the compiler fails with that code (default ``NCC_EOOM001``, over the HBM limit) -> child exit 3.
``unsupported-op``
    the compiler reports ``Unsupported operator`` without a code -> child exit 3.
``crash`` / ``segfault``
    trace: the calling process (the compile child) kills itself with SIGKILL / SIGSEGV -> child
    returncode -9 / -11. neuronx-cc script: the compiler kills itself -> child exit 4 (COMPILER_KILLED).
``slow:N``
    the compiler prints a progress line every 0.25 s for N seconds (float), then succeeds. For the
    runner's timeout and cancel tests: it runs as a grandchild in the child's process group.
``exit:N``
    the compiler prints an internal error and exits N (``exit:70``: the intermittent failure).
``missing-lib``
    the compiler fails like a binary missing ``libxml2.so.2`` ("error while loading shared
    libraries") -> infra.

Runner tests: ``env = neuron_double_env(behaviour="slow:30")`` and start the child with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

NEURON_DOUBLE_DIR = Path(__file__).resolve().parent / "neuron"
BEHAVIOUR_ENV = "COMPILESVC_NEURON_DOUBLE_BEHAVIOUR"


def _prepend(path: str, existing: str | None) -> str:
    return path if not existing else path + os.pathsep + existing


def neuron_double_env(base: Mapping[str, str] | None = None, *, behaviour: str | None = None,
                      sdk: str | None = "2.20.0") -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) with the Neuron SDK double enabled (see the module doc)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _prepend(str(NEURON_DOUBLE_DIR), env.get("PYTHONPATH"))
    env["PATH"] = _prepend(str(NEURON_DOUBLE_DIR / "bin"), env.get("PATH"))
    if behaviour is not None:
        env[BEHAVIOUR_ENV] = behaviour
    if sdk is not None:
        env["COMPILESVC_NEURON_SDK"] = sdk
    return env
