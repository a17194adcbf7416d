"""TEST DOUBLE knobs: how long an NxDI compile takes and how much host memory it needs (not in the real SDK).

``COMPILESVC_NEURON_DOUBLE_NXDI_SECONDS=N``: the compile takes N seconds (a progress line every 0.5 s), between HLO
generation and the compiler: an 8B model takes about 15 minutes (SDK vllm-user-guide-v1.rst:L496-L497).
``COMPILESVC_NEURON_DOUBLE_NXDI_MEMORY_MB=M``: the host memory the compile needs at its peak. It is compared with what
the process may have: ``COMPILESVC_NEURON_DOUBLE_NXDI_HOST_MEMORY_MB`` (a small host), else its RLIMIT_AS (the
sandbox's bound). Over it, ``COMPILESVC_NEURON_DOUBLE_NXDI_OOM`` says how it dies, as the two ways seen
(docs/research/nxdi.md §6):
``f137`` (default): neuronx-cc prints F137 and fails (exit 70; the exception is the one the trace double raises,
libneuronxla's own is not public); ``sigkill``: the kernel kills the compiling process during HLO generation,
with nothing printed (aws-neuron-sdk#1222: the log ends at "generating HLO: …", then "Killed").
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import time

SECONDS_ENV = "COMPILESVC_NEURON_DOUBLE_NXDI_SECONDS"
MEMORY_ENV = "COMPILESVC_NEURON_DOUBLE_NXDI_MEMORY_MB"
HOST_MEMORY_ENV = "COMPILESVC_NEURON_DOUBLE_NXDI_HOST_MEMORY_MB"
OOM_ENV = "COMPILESVC_NEURON_DOUBLE_NXDI_OOM"
logger = logging.getLogger("Neuron")


def memory_claim() -> int | None:
    """MiB the compile needs beyond what it may have (None: it fits)."""
    need = int(os.environ.get(MEMORY_ENV, "0") or 0)
    if not need:
        return None
    have_env = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if have_env:
        have = int(have_env)
    else:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        have = soft // (1024 * 1024) if soft != resource.RLIM_INFINITY else 0
    logger.info(f"TEST DOUBLE: this compile needs {need} MiB of host memory; it may have "
                f"{have or 'unbounded'} MiB")
    return need if have and need > have else None


def hlo_generation(short: int | None) -> None:
    if short is not None and os.environ.get(OOM_ENV, "f137") == "sigkill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        time.sleep(0.3)  # allocating takes a moment; the line reaches whatever reads the process's output
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: no message from the process itself
        time.sleep(10)


def compiler(short: int | None, f137: str) -> None:
    if short is not None and os.environ.get(OOM_ENV, "f137") != "sigkill":
        print(f137, flush=True)
        raise RuntimeError("neuronx-cc failed with 70")


def take_time() -> None:
    seconds = float(os.environ.get(SECONDS_ENV, "0") or 0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        logger.info(f"TEST DOUBLE: compiling, {deadline - time.monotonic():.1f}s left")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
