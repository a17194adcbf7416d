"""Tensor-parallel (``tp_degree > 1``) Neuron traces: which neuronx-distributed API, its rendezvous, its memory.

Owns the choice between neuronx-distributed's two tracers, how each is called, what it writes into the
artifact, and how concurrent compiles on one host stay out of each other's way. Sources are the
neuronx-distributed repository (aws-neuron/neuronx-distributed, ``src/neuronx_distributed/trace/``; commits
named below) and the SDK release notes.

**Which API.** Decided by the *installed* neuronx-distributed, not by the release the worker claims:

- ``ModelBuilder`` (``neuronx_distributed.trace.model_builder``) from neuronx-distributed 0.10 (SDK 2.21.0,
  commit 3aa65c6 "release_cut_2.21"): it traces in this one process under a mocked process group
  (``mock_distributed``), so there are no rank processes and no rendezvous, and it compiles one NEFF per
  (key, bucket) shared by every rank (SPMD). The first ModelBuilder (0.9.0, SDK 2.20.0, commit 4f95471)
  still spawned one process per rank with ``MASTER_PORT=2022`` hard-coded, so 2.20 stays on the old path.
  Calls (commit 47f695c, SDK 2.27.0): ``ModelBuilder(router, tp_degree, checkpoint_loader,
  compiler_workdir=…, logical_nc_config=…)`` (``logical_neuron_cores`` in 0.10), ``add(key, model_instance,
  example_inputs, compiler_args: str)``, ``trace(initialize_model_weights=False)`` (True would load the
  weights onto a device, which a compile host may not have) returning a TorchScript module saved with
  ``torch.jit.save``, and ``shard_checkpoint(serialize_path)`` writing one
  ``tp<rank>_sharded_checkpoint.safetensors`` per rank. Artifact: ``model.pt`` (role ``model``, no weights
  inside) and ``weights/tp<rank>_sharded_checkpoint.safetensors`` (role ``weights-shard``, with ``rank``);
  a server loads the module and gives it the ranks' weights (``nxd_model.initialize``). ``add`` fills in
  ``--auto-cast=none``, ``-O1`` and ``--verbose=35`` where the flags lack them (``append_default_compiler_flags``).
- ``parallel_model_trace`` (``neuronx_distributed.trace``) below 0.10 only: deprecated by the 2.26 release
  notes and unsupported from 2.27 (announcement-end-of-support-parallel-model-trace). One spawned process
  per rank, each loading the whole model and running its own compiler; rank processes need a Neuron
  device (``init_process_group("xla")``). Saved with ``parallel_model_save`` as ``model/tp_<rank>.pt`` (role
  ``model-shard``, with ``rank``).

**One rendezvous per port.** parallel_model_trace sets ``os.environ["MASTER_PORT"] = "2022"`` itself before
spawning the ranks (trace.py, every release 2.20-2.29), over whatever the caller set, and has no port
parameter: no value we choose can reach the ranks. So compiles that use it take a host-wide lock named
for that port (an ``flock`` on a file in the temp dir) for the whole call: a second tp > 1 compile on the
host waits instead of failing with "Address already in use". The kernel drops the lock when the child
dies, so a killed compile never leaves it held. ModelBuilder needs no port; ``MASTER_PORT`` is still set to
a free one for this child, because NxD helpers that do create a process group default it to 29500
(``parallel_layers/utils.py`` ``initialize_fallback_parallel_state``).

**Memory.** parallel_model_trace compiles every rank at once unless ``max_parallel_compilations`` bounds it;
the bound is the request's ``max_parallel_rank_compiles`` (``COMPILESVC_NEURON_MAX_PARALLEL_RANK_COMPILES``,
default host memory / 16 GiB). ModelBuilder runs one compiler per bucket whatever tp_degree is, and a
request is one bucket, so it has nothing to bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compilesvc.spec.flags import MODEL_BUILDER_NXD, nxd_quoted
from compilesvc.spec.neuron_releases import version_tuple
from workers.backends.neuron import raise_for_trace_failure, read_compiler_logs, request_lnc
from workers.backends.output_tee import OutputTee
from workers.compiling.contract import ArtifactFile, CompileRequest, InfraError, log
from workers.host.versions import neuronx_distributed_version

#: First neuronx-distributed whose ModelBuilder traces in one process (SDK 2.21.0; see the module doc).
MODEL_BUILDER_SINCE = MODEL_BUILDER_NXD
#: The rendezvous port parallel_model_trace hard-codes (neuronx_distributed/trace/trace.py).
PARALLEL_MODEL_TRACE_PORT = 2022
#: ModelBuilder's key for our one model (it names the compiler's working directory).
MODEL_KEY = "model"
WEIGHTS_DIR = "weights"


def uses_model_builder(version: str) -> bool:
    """Whether tp > 1 goes through ModelBuilder with this neuronx-distributed (see the module doc)."""
    return version_tuple(version)[:2] >= MODEL_BUILDER_SINCE


def parallel_trace(request: CompileRequest, model: Any, tensors: tuple[Any, ...], workdir: Path,
                   args: list[str], tee: OutputTee, devices: list[str]) -> tuple[list[ArtifactFile], dict[str, str]]:
    """Trace ``model`` for ``request.tp_degree`` ranks into ``request.out_dir``: the files and extra versions."""
    version = neuronx_distributed_version()
    if version is None:
        raise InfraError("NEURONX_DISTRIBUTED_MISSING", f"tp_degree {request.tp_degree} needs neuronx-distributed "
                                                        f"on this worker; it is not installed")
    if uses_model_builder(version):
        log(f"neuronx-distributed {version}: tp_degree {request.tp_degree} through ModelBuilder")
        files = _model_builder_trace(request, model, tensors, workdir, args, tee)
    else:
        log(f"neuronx-distributed {version} (before {'.'.join(map(str, MODEL_BUILDER_SINCE))}): tp_degree "
            f"{request.tp_degree} through parallel_model_trace")
        files = _parallel_model_trace(request, tensors, workdir, args, tee, devices)
    return files, {"neuronx_distributed": version}


# -- ModelBuilder ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model_builder_trace(request: CompileRequest, model: Any, tensors: tuple[Any, ...], workdir: Path,
                         args: list[str], tee: OutputTee) -> list[ArtifactFile]:
    try:
        import torch
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    except ImportError as exc:  # 0.10+ has it: a failing import is a broken install (e.g. safetensors missing)
        raise InfraError("NEURONX_DISTRIBUTED_BROKEN", f"neuronx_distributed.trace.model_builder does not import "
                                                       f"on this worker: {exc}") from exc
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    options: dict[str, Any] = {"compiler_workdir": str(workdir / "nxd")}  # trace() deletes this directory first
    # The process-group layout (NxD's replica groups) must agree with the compiler's logical cores, which the
    # compiler gets in `args` (neuron._compiler_args); ModelBuilder's own default (1) is not the compiler's on
    # trn2/trn3 (2), so it is always given. The parameter was renamed (logical_neuron_cores in 0.10).
    lnc = request_lnc(request)
    parameters = inspect.signature(ModelBuilder).parameters
    name = next((n for n in ("logical_nc_config", "logical_neuron_cores") if n in parameters), None)
    if name:
        options[name] = lnc
    else:
        log(f"this ModelBuilder takes no logical NC config: logical NeuronCores {lnc} reach the compiler only")
    weights_dir = request.out_dir / WEIGHTS_DIR
    log(f"ModelBuilder(tp_degree={request.tp_degree}, {', '.join(f'{k}={v}' for k, v in options.items())}); "
        f"one compiler run for all ranks (max_parallel_rank_compiles={request.max_parallel_rank_compiles} has "
        f"nothing to bound)")

    builder = ModelBuilder(router=None, tp_degree=request.tp_degree,
                           checkpoint_loader=lambda: dict(model.state_dict()), **options)
    # One string, which ModelBuilder appends to and libneuronxla splits shell-style: each value written as NxDI
    # writes its own (--x='v w'; MODEL_BUILDER_FLAGS_SOURCE), values with a quote too were refused at submit.
    builder.add(key=MODEL_KEY, model_instance=BaseModelInstance(lambda: model, {}), example_inputs=[tensors],
                compiler_args=" ".join(nxd_quoted(arg) for arg in args))
    try:
        with tee:
            traced = builder.trace(initialize_model_weights=False)
            builder.shard_checkpoint(str(weights_dir))  # positional: 0.10's parameter has no default
    except Exception as exc:
        raise_for_trace_failure(exc, [*tee.lines, *str(exc).splitlines(), *read_compiler_logs(workdir)])
    torch.jit.save(traced, str(request.out_dir / "model.pt"))

    files = [ArtifactFile("model.pt", "model")]
    for path in sorted(weights_dir.glob("*"), key=_rank_order):
        rank = re.search(r"tp(\d+)_", path.name)
        files.append(ArtifactFile(f"{WEIGHTS_DIR}/{path.name}", "weights-shard",
                                  {"rank": int(rank.group(1))} if rank else {}))
    if len(files) - 1 != request.tp_degree:
        raise InfraError("NO_OUTPUT", f"ModelBuilder.shard_checkpoint wrote {len(files) - 1} weight files under "
                                      f"{weights_dir}, expected one per rank ({request.tp_degree})")
    return files


def _rank_order(path: Path) -> tuple[int, str]:
    match = re.search(r"tp_?(\d+)", path.name)
    return (int(match.group(1)) if match else -1, path.name)


# -- parallel_model_trace ----------------------------------------------------------------------------------

@contextlib.contextmanager
def rendezvous_lock(port: int) -> Iterator[None]:
    """Hold the host-wide lock for rendezvous ``port`` (see the module doc): waits while another holds it."""
    path = Path(tempfile.gettempdir()) / f"compilesvc-neuron-rendezvous-{port}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for rendezvous port {port}: another tp > 1 compile on this host uses it ({path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        log(f"holding rendezvous port {port} ({path})")
        yield
    finally:
        os.close(fd)  # releases the lock


def _load_for_rank(request: CompileRequest) -> tuple[Any, dict[str, Any]]:
    """parallel_model_trace's model factory: each rank loads its own copy (module-level: picklable)."""
    from workers.compiling.model_loading import load_model

    model = load_model(request.model_path, request.model_format, request.work_dir / f"rank-{os.getpid()}",
                       [i.name for i in request.inputs], request.extract_limits)
    return model, {}


def _parallel_model_trace(request: CompileRequest, tensors: tuple[Any, ...], workdir: Path, args: list[str],
                          tee: OutputTee, devices: list[str]) -> list[ArtifactFile]:
    if not devices:
        raise InfraError("NEURON_DEVICE_REQUIRED", f"tp_degree {request.tp_degree} with this neuronx-distributed "
                                                   f"needs parallel_model_trace, whose rank processes need a Neuron "
                                                   f"device; this host has none (no /dev/neuron*)")
    try:
        from neuronx_distributed.trace import parallel_model_save, parallel_model_trace
    except ImportError as exc:
        raise InfraError("NEURONX_DISTRIBUTED_MISSING", f"tp_degree {request.tp_degree} needs neuronx-distributed "
                                                        f"on this worker: {exc}") from exc
    if request.max_parallel_rank_compiles is not None:
        limit = request.max_parallel_rank_compiles
    else:
        from compilesvc.config.settings import default_parallel_rank_compiles

        limit = default_parallel_rank_compiles()
    bound = max(1, min(request.tp_degree, limit))
    log(f"parallel_model_trace(tp_degree={request.tp_degree}, max_parallel_compilations={bound})")
    with rendezvous_lock(PARALLEL_MODEL_TRACE_PORT):
        try:
            with tee:
                traced = parallel_model_trace(functools.partial(_load_for_rank, request), tensors,
                                              compiler_workdir=str(workdir), compiler_args=args,
                                              tp_degree=request.tp_degree, max_parallel_compilations=bound)
        except Exception as exc:
            raise_for_trace_failure(exc, [*tee.lines, *str(exc).splitlines(), *read_compiler_logs(workdir)])
    model_dir = request.out_dir / "model"
    parallel_model_save(traced, str(model_dir))
    files = []
    for path in sorted((p for p in model_dir.rglob("*") if p.is_file()), key=_rank_order):
        rank = re.search(r"tp_(\d+)", path.name)
        files.append(ArtifactFile(path.relative_to(request.out_dir).as_posix(), "model-shard",
                                  {"rank": int(rank.group(1))} if rank else {}))
    if not files:
        raise InfraError("NO_OUTPUT", f"parallel_model_save wrote nothing under {model_dir}")
    return files
