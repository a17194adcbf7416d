"""TEST DOUBLE of ``neuronx_distributed.trace``: ``parallel_model_trace``/``_save``/``_load``. Not the real SDK.

Mirrors the real layout (aws-neuron/neuronx-distributed src/neuronx_distributed/trace/trace.py, release 2.29):

- one process per rank, started with the ``spawn`` method (the real one uses ``xmp.spawn``); each rank
  calls ``func()`` for its own ``(model, states)`` and traces it; rank 0 hosts the rendezvous store on
  ``MASTER_ADDR=localhost`` / ``MASTER_PORT=2022``, which the real function hard-codes over whatever the
  caller set, so two concurrent calls on one host collide: the second fails with c10d's "Address already
  in use" (message: aws-neuron-sdk archive/appnotes/torch-neuronx/introducing-pytorch-2-9.rst). Tests may
  move the port with COMPILESVC_NEURON_DOUBLE_PMT_PORT;
- ``max_parallel_compilations`` bounds how many ranks compile at once (the real one makes later ranks wait
  at rendezvous points; the double uses a semaphore) and all ranks meet at "compilation-done";
- ranks need a Neuron device (``init_process_group("xla")``; there is no ``cpu_backend``);
- release dependence: deprecated in 2.26 (a FutureWarning here), unsupported from 2.27
  (about-neuron/announcements/neuron2.x/announcement-end-of-support-parallel-model-trace.rst). The real
  0.16-0.18 packages still contain the code; the double raises so that tests see a caller relying on an
  unsupported API;
- rank ``r`` is saved as ``<dir>/tp_<r>.pt``. There is no sharding: each rank holds the whole model.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_neuronx
from _release import PMT_DEPRECATED_SINCE, PMT_PORT_ENV, PMT_UNSUPPORTED_SINCE, current, device_count

#: trace.py: os.environ["MASTER_PORT"] = "2022"
MASTER_PORT = 2022


class TensorParallelNeuronModel(torch.nn.Module):
    """The ranks' traced models; ``forward`` runs rank 0 (the double does not shard)."""

    def __init__(self, models: list[Any]):
        super().__init__()
        self.models = models

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.models[0](*inputs)


def _bind_store(port: int) -> socket.socket:
    """Rank 0's TCPStore server socket, or c10d's error when another rendezvous holds the port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", port))
        server.listen()
    except OSError as exc:
        server.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"[W socket.cpp:426] [c10d] The server socket has failed to bind to [::]:{port} (errno: 98 - "
              f"Address already in use).", flush=True)
        raise RuntimeError(f"The server socket has failed to listen on any local network address. The server "
                           f"socket has failed to bind to [::]:{port} (errno: 98 - Address already in use).") from exc
    return server


def _rank_main(rank: int, func: Callable[[], tuple[Any, Any]], example_inputs: Any, workdir: str,
               compiler_args: list[str], tp_degree: int, port: int, gate: Any, running: Any, done: Any) -> None:
    os.environ["RANK"] = str(rank)
    server = _bind_store(port) if rank == 0 else None
    try:
        if device_count() == 0:
            raise RuntimeError(torch_neuronx.NO_DEVICE_ERROR)
        with gate:
            with running.get_lock():
                running.value += 1
                now = running.value
            print(f"[neuronx_distributed TEST DOUBLE] tracing rank {rank}/{tp_degree} (ranks compiling now: "
                  f"{now})", flush=True)
            try:
                model, _states = func()
                rank_dir = Path(workdir) / f"_tp{rank}"
                traced = torch_neuronx._trace(model, example_inputs, rank_dir, compiler_args,
                                              torch_neuronx.PLATFORM_TARGET or "trn1")
                torch.jit.save(traced, str(rank_dir / "model.pt"))
            finally:
                with running.get_lock():
                    running.value -= 1
        done.wait()  # xm.rendezvous("compilation-done")
    except BaseException:
        done.abort()
        raise
    finally:
        if server is not None:
            server.close()


def parallel_model_trace(func: Callable[[], tuple[Any, Any]], example_inputs: Any, states: Any = None,
                         compiler_workdir: str | os.PathLike[str] | None = None,
                         compiler_args: str | list[str] | None = None, inline_weights_to_neff: bool = True,
                         bucket_config: Any = None, tp_degree: int = 1, max_parallel_compilations: int | None = None,
                         spmd_mode: bool = False, checkpoint_loader_callable: Callable[..., Any] | None = None,
                         force_custom_init_on_device: bool = False,
                         serialization_path: str | None = None) -> TensorParallelNeuronModel:
    """Trace ``tp_degree`` ranks, one process each (TEST DOUBLE: unsharded; see the module doc)."""
    import shlex

    release = current()
    if release.tuple >= PMT_UNSUPPORTED_SINCE:
        raise RuntimeError(f"parallel_model_trace is not supported from Neuron 2.27 (this host emulates "
                           f"{release.release}); use neuronx_distributed.trace.model_builder.ModelBuilder "
                           f"(TEST DOUBLE: the real package still contains the function)")
    if release.tuple >= PMT_DEPRECATED_SINCE:
        warnings.warn("parallel_model_trace is deprecated: Neuron 2.26 is the last release supporting it; use "
                      "ModelBuilder", FutureWarning, stacklevel=2)
    if spmd_mode or bucket_config is not None:
        raise NotImplementedError("TEST DOUBLE: spmd_mode and bucket_config are not emulated")
    args = shlex.split(compiler_args) if isinstance(compiler_args, str) else list(compiler_args or [])
    workdir = str(compiler_workdir or "/tmp/trace_compiler_workdir/")
    port = int(os.environ.get(PMT_PORT_ENV, "") or MASTER_PORT)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)  # over the caller's value, as the real one does
    os.environ["WORLD_SIZE"] = str(tp_degree)
    logging.warning("Using non SPMD mode. Set spmd_mode=True if the workload is SPMD for a faster trace. "
                    "Tracing in non SPMD mode for large models can run into OOM errors as we compile all ranks")

    # Not printed by the real function: lets tests see what the caller asked for.
    print(f"[neuronx_distributed TEST DOUBLE] parallel_model_trace tp_degree={tp_degree} "
          f"max_parallel_compilations={max_parallel_compilations} port={port}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    gate = ctx.Semaphore(max_parallel_compilations or tp_degree)
    running = ctx.Value("i", 0)
    done = ctx.Barrier(tp_degree)
    torch.multiprocessing.spawn(_rank_main, args=(func, example_inputs, workdir, args, tp_degree, port, gate,
                                                  running, done), nprocs=tp_degree, join=True, start_method="spawn")
    models = [torch.jit.load(str(Path(workdir) / f"_tp{rank}" / "model.pt")) for rank in range(tp_degree)]
    return TensorParallelNeuronModel(models)


def parallel_model_save(model: TensorParallelNeuronModel, save_dir: str | os.PathLike[str]) -> None:
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, traced in enumerate(model.models):
        torch.jit.save(traced, str(directory / f"tp_{rank}.pt"))


def parallel_model_load(model_dir: str | os.PathLike[str]) -> TensorParallelNeuronModel:
    files = sorted(Path(model_dir).glob("tp_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return TensorParallelNeuronModel([torch.jit.load(str(p)) for p in files])
