"""The compile child: one compile of one shape bucket, in its own process, driven by a request file.

Usage: ``python -m workers.backends.compile_child REQUEST_JSON_PATH``

The runner starts this in its own process group and a fresh temporary ``work_dir``, streams its stdout and
stderr line by line, enforces the time limit (by killing the group, so compiler subprocesses die too: the
child never starts a session of its own) and classifies the outcome with :func:`workers.compiling.classify.classify`.

Request (JSON object)::

    {"backend": "torchscript" | "aotinductor" | "trace" | "neuronx-cc" | "nxdi",
     "target": "cpu" | "inf2" | "trn1" | "trn2" | "trn3",
     "sdk": "2.13.0",                       # cpu: the torch release; neuron: the Neuron SDK release
     "model_path": "/abs/model file",       # already downloaded and digest-checked by the runner
                                            # (hf-checkpoint: the checkpoint directory)
     "model_format": "torchscript" | "exported-program" | "hf-dir" | "hlo" | "hf-checkpoint",
     "inputs": [{"name": "input_ids", "shape": [1, 128], "dtype": "int64"}, ...],   # nxdi: []
     "neuron_config": {...},                # nxdi only: the canonical NeuronConfig
     "nxdi_model": "pkg.module:Class",      # nxdi, optional: the NxDI class (else from config.json)
     "args": ["--auto-cast=none", "-O2"],   # canonical flags (compilesvc.spec.flags.canonical_flags)
     "tp_degree": 1,                        # optional, default 1
     "lnc": 2 | null,                       # optional; neuron: logical NeuronCores resolved at submit (key)
     "isa": "x86_64-avx512" | null,         # optional; aotinductor refuses a host with another ISA
     "max_parallel_rank_compiles": 4,       # optional; tp > 1 on parallel_model_trace: ranks compiling at once
     "out_dir": "/abs/dir",                 # artifact files go here (created if missing)
     "work_dir": "/abs/dir"}                # scratch; result.json goes here

Outcome:

- stdout: progress lines prefixed ``[compile-child]``, flushed at once, and the compiler's own output;
- ``<work_dir>/result.json`` (written atomically, after every artifact file is complete):

  - ``{"status": "ok", "files": [{"path": "model.pt", "role": "model", "bytes": N, "sha256": hex}],
    "versions": {"torch": ..., "python": ..., ...}, "compile_seconds": 1.23}``, exit 0;
  - ``{"status": "compile_error", "code": "NCC_EOOM001", "message": "one line"}``, exit 3 —
    deterministic, final for the key;
  - ``{"status": "bad_request", "code": "COMPILER_FLAG_REJECTED", "message": "one line naming the flag"}``,
    exit 5 — final for the key;
  - ``{"status": "infra_error", "code": "WRONG_HOST", "message": "one line"}``, exit 4 — retry;
  - ``{"status": "unknown_error", "code": "NEURONX_CC_EXIT_70", "message": "one line"}``, exit 6 — the
    compiler failed with no evidence of why: retried a bounded number of times
    (:mod:`workers.compiling.classify`);

- a malformed request: message on stderr, exit 2, no result.json;
- any other exception: traceback on stderr, exit 1, no result.json. The child deletes a stale
  result.json before starting, so none can be mistaken for this run's.

The child ends with ``os._exit`` after flushing, so a crash in library teardown at interpreter exit
cannot turn a finished compile into a failure (or the reverse).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from workers.backends import backend_class
from workers.compiling.contract import (
    EXIT_BAD_REQUEST,
    EXIT_OK,
    EXIT_UNCAUGHT,
    BackendFailure,
    CompileRequest,
    InfraError,
    RequestError,
    log,
)

RESULT_NAME = "result.json"
_LOG_WORDS = {"compile_error": "compile error", "bad_request": "flag rejected", "infra_error": "infrastructure error",
              "unknown_error": "unexplained failure"}


def write_result(path: Path, document: dict[str, Any]) -> None:
    """Write result.json atomically: the runner may read it the moment the child exits."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_request(path: Path) -> CompileRequest:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise RequestError(f"cannot read request file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise RequestError(f"request file {path} is not valid JSON: {exc}") from None
    return CompileRequest.from_json(data)


def run(request: CompileRequest) -> int:
    """Compile ``request`` and write its result.json; returns the exit code."""
    request.work_dir.mkdir(parents=True, exist_ok=True)
    request.out_dir.mkdir(parents=True, exist_ok=True)
    result_path = request.work_dir / RESULT_NAME
    result_path.unlink(missing_ok=True)
    log(f"start pid={os.getpid()} backend={request.backend} target={request.target} sdk={request.sdk} "
        f"format={request.model_format} tp_degree={request.tp_degree} args={list(request.args)} "
        f"inputs=" + ",".join(f"{i.name}:{i.dtype}{list(i.shape)}" for i in request.inputs))

    started = time.monotonic()
    try:
        # Checked before a backend imports torch: fails in milliseconds. An hf-checkpoint is a directory.
        if request.model_format == "hf-checkpoint":
            if not request.model_path.is_dir():
                raise InfraError("MODEL_FILE_MISSING", f"checkpoint directory {request.model_path} does not exist "
                                 "on this worker")
        elif not request.model_path.is_file():
            raise InfraError("MODEL_FILE_MISSING", f"model file {request.model_path} does not exist on this worker")
        backend = backend_class(request.backend)()
        result = backend.compile(request)
    except BackendFailure as exc:
        if exc.message != " ".join(exc.full_text.split()):  # cut for result.json: the log keeps all of it
            log(f"{_LOG_WORDS[exc.status]} {exc.code}, in full:\n{exc.full_text}")
        # "compile error CODE: ..." is also the runner's fallback when result.json goes missing (exit 3).
        log(f"{_LOG_WORDS[exc.status]} {exc.code}: {exc.message}")
        write_result(result_path, {"status": exc.status, "code": exc.code, "message": exc.message})
        return exc.exit_code
    seconds = time.monotonic() - started

    files = []
    for item in result.files:
        path = request.out_dir / item.path
        if not path.is_file():  # a backend bug, not a compile error: let it surface as unknown
            raise RuntimeError(f"backend {request.backend} reported {item.path} but did not write it")
        files.append({**item.extra, "path": item.path, "role": item.role, "bytes": path.stat().st_size,
                      "sha256": _sha256(path)})
    write_result(result_path, {"status": "ok", "files": files, "versions": result.versions,
                               "compile_seconds": round(seconds, 3)})
    log(f"ok in {seconds:.2f} s: " + ", ".join(f"{f['path']} ({f['bytes']} bytes)" for f in files))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Pipes are block-buffered by default; the runner streams lines, so flush each one.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    if len(argv) != 1:
        print("usage: python -m workers.backends.compile_child REQUEST_JSON_PATH", file=sys.stderr)
        return EXIT_BAD_REQUEST
    try:
        request = read_request(Path(argv[0]))
    except RequestError as exc:
        print(f"bad compile request: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    return run(request)


def _entry() -> None:
    try:
        code = main()
    except BaseException:  # the contract: any escape is "unknown", reported with its traceback
        traceback.print_exc()
        code = EXIT_UNCAUGHT
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _entry()
