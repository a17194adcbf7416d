"""The cpu target's backends: TorchScript tracing and AOTInductor, both with the worker's own torch.

Owns how a cpu compile maps the spec's flags (:data:`compilesvc.spec.compile_spec.CPU_BACKEND_FLAGS`) onto torch, where
AOTInductor keeps its cache, and the load-and-run check each artifact gets before it is reported (what torch
prints meanwhile is sorted out by :mod:`workers.backends.cpu_warnings`).

- ``torchscript``: ``torch.jit.trace`` at the bucket's example inputs; ``--freeze`` -> ``torch.jit.freeze``,
  ``--optimize-for-inference`` -> ``torch.jit.optimize_for_inference``; saved as ``model.pt``. Byte-identical
  across compiles of the same model, bucket and flags with the same torch.
- ``aotinductor``: ``torch.export.export`` at the bucket's inputs (static shapes) and
  ``torch._inductor.aoti_compile_and_package``; ``--freezing``/``--max-autotune`` set the inductor configs
  of the same names; saved as ``model.pt2``, a package holding a native ``.so`` built for this host's ISA.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._inductor.exc import CppCompileError

from compilesvc.hostinfo import host_isa
from compilesvc.spec.compile_spec import CPU_BACKEND_FLAGS
from compilesvc.spec.flags import canonical_flags, flag_names
from compilesvc.spec.neuron_releases import base_version
from workers.backends.cpu_warnings import (
    GUARDS_TRACER_WARNING,
    LEAFSPEC_FUTURE_WARNING,
    kept_tracer_warnings,
    silenced,
    value_reads,
)
from workers.compiling.contract import (
    ArtifactFile,
    Backend,
    CompileFailure,
    CompileRequest,
    CompileResult,
    InfraError,
    log,
)
from workers.compiling.model_loading import (
    example_inputs,
    load_model,
    order_inputs,
    raise_if_host_trouble,
    run_forward,
)
from workers.compiling.workdirs import INDUCTOR_CACHE_NAME
from workers.host.versions import python_version

# Outputs of the artifact and of eager torch must agree this closely at the example inputs. Loose enough
# for --optimize-for-inference (oneDNN kernels) and inductor's fused kernels, tight enough to catch a
# wrong graph.
RTOL = 1e-3
ATOL = 1e-4


def _check_flags(request: CompileRequest) -> set[str]:
    """The request's flag names, refusing any the backend does not understand (the spec already does)."""
    names = flag_names(canonical_flags(request.args))
    unknown = names - CPU_BACKEND_FLAGS[request.backend]
    if unknown:
        raise CompileFailure("CPU_BAD_FLAG", f"flags {sorted(unknown)} are not understood by the cpu "
                                             f"{request.backend} backend")
    return names


def _check_torch(request: CompileRequest) -> None:
    # The cpu target's "sdk" is the torch release; a worker with another torch was routed the wrong queue.
    if base_version(torch.__version__) != request.sdk:
        raise InfraError("WRONG_SDK", f"this worker has torch {torch.__version__}, the request needs "
                                      f"{request.sdk}")


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) model output, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _leaves(v)]
    return []


def verify_outputs(run: Callable[[], Any], expected: Any, code: str) -> None:
    """Run the saved artifact and compare with eager outputs; a mismatch is a deterministic ``code`` error."""
    with torch.no_grad():
        got = run()
    got_leaves, expected_leaves = _leaves(got), _leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        raise CompileFailure(code, f"artifact returns {len(got_leaves)} tensors, the model "
                                   f"{len(expected_leaves)}")
    for index, (a, b) in enumerate(zip(got_leaves, expected_leaves, strict=True)):
        if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL, equal_nan=True):
            diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
            raise CompileFailure(code, f"artifact output {index} differs from eager torch (max abs diff {diff})")


def _prepare(request: CompileRequest, code: str) -> tuple[torch.nn.Module, list[torch.Tensor], Any]:
    """Load the model, build the bucket's example inputs in forward's order, and run it once eagerly."""
    t0 = time.monotonic()
    model = load_model(request.model_path, request.model_format, request.work_dir,
                       [i.name for i in request.inputs], request.extract_limits)
    ordered = order_inputs(model, request.inputs)
    tensors = example_inputs(ordered)
    log(f"loaded {request.model_format} model in {time.monotonic() - t0:.2f} s; inputs "
        + ", ".join(f"{d.name}:{d.dtype}{list(d.shape)}" for d in ordered))
    eager = run_forward(model, tensors, code)
    return model, tensors, eager


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "python": python_version(), "isa": host_isa()}


def trace_bucket(model: torch.nn.Module, tensors: Sequence[torch.Tensor], flags: set[str]) -> torch.jit.ScriptModule:
    """``model`` as TorchScript at this bucket's example inputs, frozen/optimised as ``flags`` ask.

    torch's warnings about its own machinery are silenced where known to be harmless (one log line
    each); the model's own TracerWarnings are shown, after a line explaining them.
    """
    if isinstance(model, torch.jit.ScriptModule):
        # torch.jit.trace returns a ScriptModule as it is, with a UserWarning "tracing it is a no-op"
        # (torch/jit/_trace.py, _trace_impl): say so once here instead of calling it for that warning.
        log("the model is TorchScript already: used as loaded (tracing a ScriptModule is a no-op), so the "
            "artifact keeps its graph as it is rather than one specialised to this bucket's shapes")
    reads = value_reads(model)
    if reads:
        log(f"warning: the model reads tensor values into Python numbers ({', '.join(reads)}): torch.jit.trace "
            "keeps the numbers of this bucket's example inputs as constants, so the artifact may be wrong for "
            "other input values (torch prints no TracerWarning for this); the aotinductor backend keeps them")
    harmless = [GUARDS_TRACER_WARNING] if hasattr(model, "_guards_fn") else []
    with torch.no_grad(), silenced(harmless), kept_tracer_warnings():
        # strict=False lets models return dicts/lists, as Hugging Face-style heads do.
        traced = (model if isinstance(model, torch.jit.ScriptModule)
                  else torch.jit.trace(model, tuple(tensors), strict=False))  # type: ignore[no-untyped-call]
        traced.eval()
        if "--freeze" in flags:
            traced = torch.jit.freeze(traced)
        if "--optimize-for-inference" in flags:
            traced = torch.jit.optimize_for_inference(traced)
    return traced


class TorchScriptBackend(Backend):
    """``torch.jit.trace`` at the bucket's shapes, optionally frozen/optimised, saved as ``model.pt``."""

    name = "torchscript"

    def compile(self, request: CompileRequest) -> CompileResult:
        flags = _check_flags(request)
        _check_torch(request)
        model, tensors, eager = _prepare(request, "CPU_TRACE_ERROR")
        t0 = time.monotonic()
        try:
            traced = trace_bucket(model, tensors, flags)
        except Exception as exc:
            raise_if_host_trouble(exc)
            raise CompileFailure("CPU_TRACE_ERROR", f"torch.jit.trace failed: {type(exc).__name__}: {exc}") from exc
        log(f"traced in {time.monotonic() - t0:.2f} s (flags: {' '.join(sorted(flags)) or 'none'})")

        out = request.out_dir / "model.pt"
        torch.jit.save(traced, str(out))
        verify_outputs(lambda: torch.jit.load(str(out), map_location="cpu")(*tensors),  # type: ignore[no-untyped-call]
                       eager, "CPU_TRACE_ERROR")
        log(f"saved {out.name} ({out.stat().st_size} bytes); reloaded output matches eager")
        return CompileResult(files=[ArtifactFile("model.pt", "model")],
                             versions={**_versions(), "backend": self.name})


#: Native code is built for the key's ISA level, not -march=native: two hosts of one level may differ in
#: extensions (VNNI, FP16) that a -march=native build would use and the other host lacks.
MARCH_FOR_ISA_LEVEL = {"avx512_amx": "sapphirerapids", "avx512": "x86-64-v4", "avx2": "x86-64-v3",
                       "default": "x86-64"}


def compile_identity(request: CompileRequest) -> str:
    """A digest of everything that decides what this compile generates (model bytes, shapes, flags, ISA)."""
    digest = hashlib.sha256()
    with open(request.model_path, "rb") as model:
        while chunk := model.read(1 << 20):
            digest.update(chunk)
    described = {"backend": request.backend, "sdk": request.sdk, "isa": request.isa, "args": list(request.args),
                 "inputs": [[i.name, list(i.shape), i.dtype] for i in request.inputs]}
    digest.update(json.dumps(described, sort_keys=True).encode())
    return digest.hexdigest()[:32]


@contextlib.contextmanager
def inductor_cache(request: CompileRequest) -> Iterator[Path]:
    """An empty inductor cache at a fixed path for this compile's identity, held exclusively meanwhile.

    Why a fixed path: AOTInductor's generated sources and the ``.so`` built from them embed the cache
    directory's path, so the same compile in a different directory gives different bytes. The runner
    makes a fresh, randomly named work dir per compile, so the cache lives under the work dir's parent,
    named by the compile's identity: a recompile of the same bucket reuses the path (same bytes), and
    different buckets use different paths, so they compile in parallel. Why emptied: kernels cached by an
    earlier compile change what is generated now. Why locked: only a second compile of the very same
    identity on this host (a duplicate that slipped past the ledger) must wait.
    """
    root = request.work_dir.parent / INDUCTOR_CACHE_NAME
    root.mkdir(parents=True, exist_ok=True)
    identity = compile_identity(request)
    cache = root / identity
    lock_path = root / f"{identity}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for the inductor cache lock {lock_path} (the same compile is running on this host)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # inductor reads it on every use
            try:
                yield cache
            finally:
                if previous is None:
                    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
                shutil.rmtree(cache, ignore_errors=True)  # the bytes are in out_dir; don't grow the disk
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cxx_version() -> str | None:
    """First line of the C++ compiler's --version: the native code in a .pt2 depends on it."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
        first = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        return first.splitlines()[0].strip() if first else None
    except Exception:  # informational only; never fail a compile over it
        return None


_TOOLCHAIN_TROUBLE = ("no working c++ compiler", "no such file or directory", "command not found",
                      "cannot find -l", "permission denied")


def _raise_if_toolchain_trouble(exc: BaseException) -> None:
    """A missing or broken C++ toolchain (compiler, headers, libraries) is this host's problem."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if "invalidcxxcompiler" in text or any(marker in text for marker in _TOOLCHAIN_TROUBLE):
        raise InfraError("CXX_TOOLCHAIN", f"the host's C++ toolchain failed: {exc}") from exc


def _cpp_compile_error(exc: BaseException) -> CppCompileError | None:
    """The C++ compiler's failure behind an AOTInductor exception (InductorError wraps it), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, CppCompileError):
            return current
        seen.add(id(current))
        inner = getattr(current, "inner_exception", None)  # torch._inductor.exc.InductorError
        current = inner if isinstance(inner, BaseException) else current.__cause__ or current.__context__
    return None


def _inductor_failure(exc: BaseException) -> str:
    """The message of a failed AOTInductor compile, the compiler's own output first.

    CppCompileError's text is "C++ compile error / Command: <the whole g++ line> / Output: <the errors>"
    (torch/_inductor/exc.py): the command alone can fill a stored message, so it goes to the log instead,
    and the message is the output, whose first error is the one that matters (later ones often follow
    from it)."""
    cpp = _cpp_compile_error(exc)
    if cpp is None:
        return f"AOTInductor failed: {type(exc).__name__}: {exc}"
    log("the C++ compiler failed; its command: " + " ".join(cpp.cmd))
    return f"AOTInductor failed: the C++ compiler failed: {cpp.output}"


class AOTInductorBackend(Backend):
    """``torch.export`` + ``aoti_compile_and_package`` at the bucket's static shapes, saved as ``model.pt2``."""

    name = "aotinductor"

    def compile(self, request: CompileRequest) -> CompileResult:
        flags = _check_flags(request)
        isa = host_isa()
        # The .so is built with -march=native; the ISA is in the key, and a mismatch means misrouting.
        if request.isa is not None and request.isa != isa:
            raise InfraError("WRONG_HOST", f"request is for ISA {request.isa}, this host is {isa}")
        _check_torch(request)
        model, tensors, eager = _prepare(request, "CPU_EXPORT_ERROR")

        t0 = time.monotonic()
        try:
            exported = torch.export.export(model, tuple(tensors), strict=False)
        except Exception as exc:
            raise_if_host_trouble(exc)
            raise CompileFailure("CPU_EXPORT_ERROR", f"torch.export failed: {type(exc).__name__}: {exc}") from exc
        log(f"exported in {time.monotonic() - t0:.2f} s")

        configs: dict[str, Any] = {}
        if "--freezing" in flags:
            configs["freezing"] = True
        if "--max-autotune" in flags:
            configs["max_autotune"] = True
        march = MARCH_FOR_ISA_LEVEL.get(isa.split("-", 1)[1]) if isa.startswith("x86_64-") else None
        if march:
            configs["cpp.march"] = march
        # The package's internal folder is named after the file's stem: a fixed name keeps bytes stable.
        out = request.out_dir / "model.pt2"
        # A wrong input shape would abort the process in C++ without this; we want an exception.
        os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
        with inductor_cache(request) as cache:
            log(f"AOTInductor compiling (inductor cache {cache}, configs {configs or 'default'})")
            t0 = time.monotonic()
            try:
                with silenced([LEAFSPEC_FUTURE_WARNING]):
                    torch._inductor.aoti_compile_and_package(exported, package_path=str(out),
                                                             inductor_configs=configs)
            except Exception as exc:
                raise_if_host_trouble(exc)
                _raise_if_toolchain_trouble(exc)
                raise CompileFailure("CPU_INDUCTOR_ERROR", _inductor_failure(exc)) from exc
            log(f"AOTInductor compiled in {time.monotonic() - t0:.2f} s")
            verify_outputs(lambda: torch._inductor.aoti_load_package(str(out))(*tensors), eager,
                           "CPU_INDUCTOR_ERROR")
        log(f"saved {out.name} ({out.stat().st_size} bytes); reloaded output matches eager")
        versions = {**_versions(), "backend": self.name}
        cxx = _cxx_version()
        if cxx:
            versions["cxx"] = cxx
        return CompileResult(files=[ArtifactFile("model.pt2", "model")], versions=versions)

