"""The Neuron persistent compile cache of one compile: a directory of its own inside its work directory.

What the SDK does (sources): since SDK 2.23.0 neuronx-distributed's ``ModelBuilder.trace`` compiles every
bucket through ``libneuronxla.neuron_xla_compile(..., use_cache=True, cache_dir=None,
retry_failed_compilation=False, ...)`` (aws-neuron/neuronx-distributed commit e834945 "Release 2.23.0",
``src/neuronx_distributed/trace/model_builder.py`` ``submit_compilation_job_with_cache``; NxD Inference's guide
calls the cache on by default). With ``cache_dir=None`` the location is ``--cache_dir=<url>`` in
``NEURON_CC_FLAGS``, else ``NEURON_COMPILE_CACHE_URL``, else ``/var/tmp/neuron-compile-cache``
(aws-neuron-sdk ``about-neuron/arch/neuron-features/neuron-caching.rst``: "--cache_dir is prioritized over
... NEURON_COMPILE_CACHE_URL"; the same order as libneuronxla's ``CacheUrl.get_cache_url(cache_dir=None)``
in huggingface/optimum-neuron ``optimum/neuron/cache/AGENTS.md``). Left alone that cache is shared by every
compile on the host (lock files included), grows without bound, keeps failed entries that block the same
graph for good ("Got a cached failed neff ... Will skip compilation", neuron-caching.rst), and never hits
for us anyway: its key hashes the compiler flags, which hold ``--logfile=<absolute path in the work
directory>`` (``get_hash_module``), and every attempt has a new work directory.

Why not disable it: ``ModelBuilder`` passes ``use_cache=True`` explicitly, and whether libneuronxla's
``neuron_xla_compile`` honours ``--no_cache`` from ``NEURON_CC_FLAGS`` over that argument is not in any
public source (libneuronxla ships without source; the caching doc describes ``--no_cache`` for the
``neuron_cc_wrapper``). So each compile gets an empty cache directory in its work directory
(:func:`own_compile_cache`): nothing is shared, it goes when the attempt's work directory is removed, and an
empty cache always misses, so the NEFF is what the compiler writes, as without a cache. The location is a
path, not a compiler flag, and is in no key. ``torch_neuronx.trace`` (tp = 1) does not use the cache (the
caching doc: "this caching mechanism doesn't apply to the torch-neuronx trace API"); it gets the same
directory anyway, so no path of ours can reach a shared one.

A corrupt entry shows as a bare ``[NLA001] Unhandled exception with message: [json.exception.parse_error.101]``,
whose documented fix is "Delete the compiler cache ... and retry" (aws-neuron-sdk
``tools/neuron-agentic-development/developer_guides/neuron-framework-autoport.rst``): the classification
table calls it infrastructure (``COMPILE_CACHE_CORRUPT``, :mod:`workers.compiling.failure_table`), the backend
removes the cache (:func:`discard_compile_cache`), and the attempt is retried with a fresh one.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from workers.compiling.contract import log
from workers.isolation.child_env import NEURON_CC_FLAGS

CACHE_URL_ENV = "NEURON_COMPILE_CACHE_URL"
#: The compile's cache, under its work directory (not under ``neuron/nxd``: ModelBuilder empties that first).
CACHE_DIR_NAME = "neuron-compile-cache"


def _without_cache_dir(flags: str) -> tuple[list[str], bool]:
    """``flags`` split as the wrapper does, without any ``--cache_dir``; and whether there was one."""
    words = shlex.split(flags)
    kept: list[str] = []
    dropped = False
    skip = False
    for index, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word.startswith("--cache_dir="):
            dropped = True
        elif word == "--cache_dir":
            dropped, skip = True, index + 1 < len(words)
        else:
            kept.append(word)
    return kept, dropped


def own_compile_cache(work_dir: Path) -> Path:
    """Point this process's Neuron compile cache at a fresh directory in ``work_dir`` (before the SDK is
    imported); returns it. An operator's ``--cache_dir`` in NEURON_CC_FLAGS would win over the variable, so it
    is replaced by this directory (the other flags are kept as they were)."""
    cache = work_dir / CACHE_DIR_NAME
    cache.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_URL_ENV] = str(cache)
    raw = os.environ.get(NEURON_CC_FLAGS, "")
    words, replaced = _without_cache_dir(raw)
    if replaced:
        os.environ[NEURON_CC_FLAGS] = shlex.join([*words, f"--cache_dir={cache}"])
        log(f"{NEURON_CC_FLAGS}: --cache_dir replaced by this compile's own cache")
    log(f"{CACHE_URL_ENV}={cache} (this compile's own persistent cache, removed with its work directory)")
    return cache


def discard_compile_cache() -> None:
    """Remove the cache :func:`own_compile_cache` set up (after a corrupt entry): only a directory of that
    name, never a location this process did not choose."""
    current = os.environ.get(CACHE_URL_ENV)
    if current and Path(current).name == CACHE_DIR_NAME:
        shutil.rmtree(current, ignore_errors=True)
        log(f"removed the compile cache {current}: a corrupt entry; the attempt is retried with a fresh one")
