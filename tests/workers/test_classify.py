"""workers.classify: the table of outcomes, and the log patterns behind it."""

from __future__ import annotations

from typing import Any

import pytest

from workers.classify import Outcome, classify, find_compiler_error, find_infra_hint

OK = {"status": "ok", "files": [{"path": "model.pt", "role": "model"}], "versions": {}, "compile_seconds": 1.0}
NUMPY_WARNING = ("/venv/torch/_subclasses/functional_tensor.py:368: UserWarning: Failed to initialize NumPy: "
                 "No module named 'numpy'")
NCC_OOM = ("2026-05-09T07:35:25Z ERROR 4242 [neuronx-cc]: [NCC_EOOM001] Estimated peak HBM usage (34.2 GB) "
           "exceeds 16 GB")


def compile_error(code: str, message: str = "boom") -> dict[str, Any]:
    return {"status": "compile_error", "code": code, "message": message}


def infra_error(code: str, message: str = "host trouble") -> dict[str, Any]:
    return {"status": "infra_error", "code": code, "message": message}


# id, returncode, result, log tail, timed_out, cancelled, expected error_class, expected code, message part
CASES: list[tuple[str, int, dict[str, Any] | None, list[str], bool, bool, str | None, str | None, str]] = [
    ("success", 0, OK, ["[compile-child] ok"], False, False, None, None, "ok"),
    ("success with noise in the log", 0, OK, [NUMPY_WARNING, NCC_OOM], False, False, None, None, "ok"),
    ("exit 0 without result", 0, None, [], False, False, "infra", "PROTOCOL", "missing"),
    ("exit 0 with compile_error result", 0, compile_error("X"), [], False, False, "infra", "PROTOCOL", "compile_error"),
    ("child compile error", 3, compile_error("CPU_TRACE_ERROR", "shape mismatch"), [NUMPY_WARNING], False, False,
     "compile", "CPU_TRACE_ERROR", "shape mismatch"),
    ("child NCC compile error", 3, compile_error("NCC_EOOM001", "over HBM"), [NCC_OOM], False, False,
     "compile", "NCC_EOOM001", "over HBM"),
    ("NCC code in the log, no result", 1, None, ["Traceback ...", NCC_OOM, "RuntimeError: neuronx-cc failed with 1"],
     False, False, "compile", "NCC_EOOM001", "[NCC_EOOM001] Estimated peak HBM"),
    ("NCC_EVRF code", 1, None, ["ERROR [NCC_EVRF007] verifier failed on op %add.3"], False, False,
     "compile", "NCC_EVRF007", "verifier failed"),
    ("unsupported operator", 1, None, ["ERROR: Unsupported operator: aten::_fft_r2c"], False, False,
     "compile", "UNSUPPORTED_OPERATOR", "aten::_fft_r2c"),
    ("unsupported op, lower case", 1, None, ["torch_neuronx: unsupported op aten::foo in graph"], False, False,
     "compile", "UNSUPPORTED_OPERATOR", "aten::foo"),
    ("exit 3, result lost, own log line", 3, None, ["[compile-child] compile error CPU_EXPORT_ERROR: guard failed"],
     False, False, "compile", "CPU_EXPORT_ERROR", "guard failed"),
    ("SIGKILL, silent log", -9, None, ["[compile-child] start", NUMPY_WARNING], False, False, "infra", "SIGKILL",
     "possibly OOM-killed"),
    ("SIGKILL after an NCC code", -9, None, [NCC_OOM], False, False, "infra", "SIGKILL", "killed by SIGKILL"),
    ("SIGKILL with host OOM in the log", -9, None, ["Out of memory: Killed process 4242 (python)"], False, False,
     "infra", "SIGKILL", "HOST_OOM"),
    ("SIGSEGV", -11, None, ["Fatal Python error: Segmentation fault"], False, False, "infra", "SIGSEGV",
     "killed by SIGSEGV"),
    ("SIGTERM with a compile_error result", -15, compile_error("X"), [], False, False, "infra", "SIGTERM",
     "SIGTERM"),
    ("missing shared library", 127, None,
     ["neuronx-cc: error while loading shared libraries: libxml2.so.2: cannot open shared object file"],
     False, False, "infra", "SHARED_LIBRARY", "libxml2.so.2"),
    ("missing shared library beats an NCC code", 1, None,
     ["ImportError: libnrt.so.1: cannot open shared object file", NCC_OOM], False, False, "infra", "SHARED_LIBRARY",
     "libnrt"),
    ("missing module", 1, None, ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"],
     False, False, "infra", "MISSING_MODULE", "No module named 'x'"),
    ("a numpy warning is not a missing module", 1, None, [NUMPY_WARNING, NCC_OOM], False, False, "compile",
     "NCC_EOOM001", "NCC_EOOM001"),
    ("host MemoryError", 1, None, ["Traceback (most recent call last):", "MemoryError"], False, False, "infra",
     "HOST_OOM", "MemoryError"),
    ("torch cannot allocate", 1, None,
     ["RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"],
     False, False, "infra", "HOST_OOM", "can't allocate memory"),
    ("disk full", 1, None, ["OSError: [Errno 28] No space left on device"], False, False, "infra", "DISK_FULL",
     "No space left"),
    ("exit 70 is intermittent", 70, None, ["Internal compiler error"], False, False, "infra", "EXIT_70",
     "intermittent"),
    ("exit 70 beats an NCC code", 70, None, [NCC_OOM], False, False, "infra", "EXIT_70", "intermittent"),
    ("child infra_error result", 4, infra_error("WRONG_HOST", "isa mismatch"), [], False, False, "infra",
     "WRONG_HOST", "isa mismatch"),
    ("child infra_error exit 70", 70, infra_error("NEURONX_CC_EXIT_70", "neuronx-cc failed with 70"), [], False,
     False, "infra", "NEURONX_CC_EXIT_70", "failed with 70"),
    ("unknown exit", 1, None, ["Traceback (most recent call last):", "KeyError: 'x'"], False, False, "infra",
     "EXIT_1", "KeyError: 'x'"),
    ("unknown exit, no output", 2, None, [], False, False, "infra", "EXIT_2", "no output"),
    ("shell-style signal exit", 137, None, [], False, False, "infra", "EXIT_137", "SIGKILL"),
    ("timeout", -9, None, ["progress: pass 12"], True, False, "timeout", "TIMEOUT", "progress: pass 12"),
    ("cancelled wins over timeout", -9, None, [], True, True, "cancelled", "CANCELLED", "cancelled"),
    ("cancelled after success", 0, OK, [], False, True, "cancelled", "CANCELLED", "cancelled"),
]


@pytest.mark.parametrize(("returncode", "result", "tail", "timed_out", "cancelled", "error_class", "code", "part"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_classify(returncode: int, result: dict[str, Any] | None, tail: list[str], timed_out: bool,
                  cancelled: bool, error_class: str | None, code: str | None, part: str) -> None:
    outcome = classify(returncode, result, tail, timed_out, cancelled)
    assert (outcome.error_class, outcome.code) == (error_class, code), outcome
    assert part in outcome.message
    assert "\n" not in outcome.message and len(outcome.message) <= 500


@pytest.mark.parametrize(("error_class", "ok", "retryable"), [
    (None, True, False), ("compile", False, False), ("cancelled", False, False), ("infra", False, True),
    ("timeout", False, True),
])
def test_outcome_flags(error_class: Any, ok: bool, retryable: bool) -> None:
    outcome = Outcome(error_class, None, "")
    assert (outcome.ok, outcome.retryable) == (ok, retryable)


def test_messages_are_one_bounded_line() -> None:
    outcome = classify(1, None, ["x" * 2000 + "\n" + "y"], False, False)
    assert len(outcome.message) <= 500 and "\n" not in outcome.message


def test_first_compiler_code_wins_and_ncc_lines_are_no_host_hint() -> None:
    lines = ["[NCC_EOOM001] over the HBM limit: Cannot allocate memory on device", "[NCC_EVRF001] later"]
    assert find_compiler_error(lines) == ("NCC_EOOM001", lines[0])
    assert find_infra_hint(lines) is None
    assert find_compiler_error(["Compiler status PASS"]) is None
