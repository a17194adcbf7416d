"""workers.compiling.classify: every row of the classification table, and the runner's rules around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compilesvc.compiles.failures import CUT_MARK, MAX_MESSAGE, shorten
from compilesvc.states import ErrorClass
from workers.compiling.classify import Outcome, classify, judge
from workers.compiling.contract import MAX_MESSAGE_CHARS, CompileFailure, one_line
from workers.compiling.error_codes import CODE_FAMILIES, for_release, nondeterministic
from workers.compiling.failure_table import TABLE, Evidence

REPO = Path(__file__).resolve().parents[3]
OK = {"status": "ok", "files": [{"path": "model.pt", "role": "model"}], "versions": {}, "compile_seconds": 1.0}
NUMPY_WARNING = ("/venv/torch/_subclasses/functional_tensor.py:368: UserWarning: Failed to initialize NumPy: "
                 "No module named 'numpy'")
NCC_OOM = ("2026-05-09T07:35:25Z ERROR 4242 [neuronx-cc]: [NCC_EOOM001] Estimated peak HBM usage (34.2 GB) "
           "exceeds 16 GB")
# Shapes of real output: aws-neuron-sdk#1303 (internal code), #947 (bare code behind the wrapper's line).
NCC_INTERNAL = "2026-03-30T13:32:48Z ERROR 77 [neuronx-cc]: [INTERNAL_ERROR] [NCC_IXCG856] MATCH_REPLACE8 " \
               "Instruction expects at least 8 input elements per partition"
BARE_TEN404 = ("2024-08-15 14:01:20.000062:  1320  ERROR ||NEURON_CC_WRAPPER||: Failed compilation with "
               "['neuronx-cc', 'compile', '--target=trn1']: 2024-08-15T14:01:19Z [TEN404] (aten__add_add.31237) "
               "Internal tensorizer error: NeuronValueNumbering:insertAtEnd()")
LOWERING = ("RuntimeError: Error while lowering: [] aten::inverse, xla_shape=f32[2,3]{1,0}, dynamic_dims: () "
            "XLA builder error: INVALID_ARGUMENT")
RUNTIME = ("RuntimeError",)
MRO_OS = ("FileNotFoundError", "OSError", "Exception", "BaseException", "object")

# neuronx-cc's driver reports any unhandled exception behind an internal code (aws-neuron-sdk#1118, #948,
# #1314); a host error raised inside the compiler arrives that way.
UNHANDLED = ("2026-05-09T07:35:25Z USER 4242 [neuronx-cc]: [INTERNAL_ERROR] [NCC_INLA001] Unhandled exception with "
             "message: {} - Please open a support ticket at https://github.com/aws-neuron/aws-neuron-sdk/issues/new")

# id, evidence, expected row, class, code, a part of the message
#: The bare form the autoport guide quotes, completed with nlohmann::json's wording for an empty document.
F137 = ("[F137] neuronx-cc was forcibly killed - This most commonly occurs due to insufficient system memory. Using "
        "a smaller data type, dimensions, batch size, or a larger instance type may help.")
CORRUPT_CACHE = ("[NLA001] Unhandled exception with message: [json.exception.parse_error.101] parse error at line "
                 "1, column 1: syntax error while parsing value - unexpected end of input")
JUDGE_CASES: list[tuple[str, Evidence, str, ErrorClass, str, str]] = [
    ("shared library, CLI", Evidence(["neuronx-cc: error while loading shared libraries: libxml2.so.2: cannot "
                                      "open shared object file: No such file or directory"], 127),
     "missing-shared-library", ErrorClass.INFRA, "SHARED_LIBRARY", "libxml2.so.2"),
    ("shared library beats an NCC code", Evidence(["ImportError: libnrt.so.1: cannot open shared object file",
                                                    NCC_OOM], 70),
     "missing-shared-library", ErrorClass.INFRA, "SHARED_LIBRARY", "libnrt"),
    ("OOM-killed CLI", Evidence(["progress"], -9), "killed-by-signal", ErrorClass.INFRA, "COMPILER_KILLED",
     "killed by SIGKILL (possibly OOM-killed: this worker's host has"),
    # neuronx-cc's own text for it (docs/research/nxdi.md §6): host memory, never a compile error, although
    # "[F137]" looks like a bare code.
    ("F137, exit 70", Evidence([F137], 70), "compiler-out-of-host-memory", ErrorClass.INFRA, "HOST_OOM",
     "ran out of host memory: [F137] neuronx-cc was forcibly killed"),
    ("F137 beats a code printed before it", Evidence(["[F134] earlier", NCC_OOM, F137], 70),
     "compiler-out-of-host-memory", ErrorClass.INFRA, "HOST_OOM", "COMPILESVC_SANDBOX_MEMORY_MB"),
    ("segfault beats a code printed before it", Evidence([NCC_OOM], -11), "killed-by-signal", ErrorClass.INFRA,
     "COMPILER_KILLED", "SIGSEGV"),
    ("disk full", Evidence(["OSError: [Errno 28] No space left on device", "[NCC_IBIR001] write failed"], 70),
     "disk-full", ErrorClass.INFRA, "DISK_FULL", "No space left"),
    ("disk full behind an internal code", Evidence([UNHANDLED.format("[Errno 28] No space left on device: '/w/n'"),
                                                    "Type: <class 'OSError'>"], 70),
     "disk-full", ErrorClass.INFRA, "DISK_FULL", "No space left on device"),
    ("bad_alloc behind an internal code", Evidence([UNHANDLED.format("std::bad_alloc"),
                                                    "Type: <class 'MemoryError'>"], 70),
     "host-out-of-memory", ErrorClass.INFRA, "HOST_OOM", "std::bad_alloc"),
    ("EIO behind an internal code", Evidence([UNHANDLED.format("[Errno 5] Input/output error: '/w/m.pb'")], 70),
     "host-os-error", ErrorClass.INFRA, "HOST_OS_ERROR", "Input/output error"),
    ("EIO behind a bare pre-2.21 code", Evidence(["[NLA001]  Unhandled exception with message: [Errno 5] "
                                                  "Input/output error: '/w/m.pb'"], 70),
     "host-os-error", ErrorClass.INFRA, "HOST_OS_ERROR", "Input/output error"),
    ("a CLI traceback ending in PermissionError", Evidence(["Traceback (most recent call last):",
                                                           "PermissionError: [Errno 13] Permission denied: '/w'"], 1),
     "host-os-error", ErrorClass.INFRA, "HOST_OS_ERROR", "Permission denied"),
    ("a user-facing code is never host trouble", Evidence(["[NCC_EARG001] bad config: OSError: [Errno 22] x"], 70),
     "ncc-error-code", ErrorClass.COMPILE, "NCC_EARG001", "bad config"),
    ("an errno in a warning is no OSError", Evidence(["WARNING: could not read /sys/x ([Errno 2])", NCC_INTERNAL], 70),
     "ncc-internal-code", ErrorClass.COMPILE, "NCC_IXCG856", "MATCH_REPLACE8"),
    ("host MemoryError line", Evidence(["Traceback (most recent call last):", "MemoryError"], 1),
     "host-out-of-memory", ErrorClass.INFRA, "HOST_OOM", "MemoryError"),
    ("host MemoryError raised in trace", Evidence([], None, exception=("MemoryError", "Exception")),
     "host-out-of-memory", ErrorClass.INFRA, "HOST_OOM", ""),
    ("torch cannot allocate", Evidence(["RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                        "can't allocate memory"], 1),
     "host-out-of-memory", ErrorClass.INFRA, "HOST_OOM", "can't allocate memory"),
    ("the device's HBM is no host hint", Evidence(["[NCC_EOOM001] over HBM: Cannot allocate memory on device"], 70),
     "ncc-error-code", ErrorClass.COMPILE, "NCC_EOOM001", "over HBM"),
    ("missing module", Evidence(["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"],
                                1),
     "missing-module", ErrorClass.INFRA, "MISSING_MODULE", "No module named 'x'"),
    ("a numpy warning is no missing module", Evidence([NUMPY_WARNING, NCC_OOM], 70), "ncc-error-code",
     ErrorClass.COMPILE, "NCC_EOOM001", "[NCC_EOOM001] Estimated peak HBM"),
    ("ImportError raised in trace", Evidence(["ImportError: cannot import name 'x'"], None,
                                             exception=("ImportError", "Exception")),
     "missing-module", ErrorClass.INFRA, "MISSING_MODULE", "cannot import name"),
    ("trace without the compiler binary", Evidence(["RuntimeError: neuronx-cc compiler binary does not exist"], None,
                                                   exception=("RuntimeError", "Exception")),
     "missing-module", ErrorClass.INFRA, "MISSING_MODULE", "compiler binary does not exist"),
    ("OSError raised in trace", Evidence(["FileNotFoundError: [Errno 2] No such file: 'w/graph.neff'"], None,
                                         exception=MRO_OS),
     "host-os-error", ErrorClass.INFRA, "HOST_OS_ERROR", "No such file"),
    ("unknown flag", Evidence(["usage: neuronx-cc compile [-h] ...",
                               "neuronx-cc compile: error: unrecognized arguments: --no-such-flag=1"], 2),
     "rejected-flag", ErrorClass.BAD_REQUEST, "COMPILER_FLAG_REJECTED", "rejected --no-such-flag=1"),
    ("invalid choice", Evidence(["neuronx-cc compile: error: argument --auto-cast: invalid choice: 'most' "
                                 "(choose from 'none', 'matmult', 'all')"], 2),
     "rejected-flag", ErrorClass.BAD_REQUEST, "COMPILER_FLAG_REJECTED", "rejected --auto-cast"),
    ("missing value", Evidence(["neuronx-cc compile: error: argument --lnc/-lnc: expected one argument"], 2),
     "rejected-flag", ErrorClass.BAD_REQUEST, "COMPILER_FLAG_REJECTED", "rejected --lnc/-lnc"),
    ("ambiguous option", Evidence(["neuronx-cc compile: error: ambiguous option: --auto could match "
                                   "--auto-cast, --auto-cast-type"], 2),
     "rejected-flag", ErrorClass.BAD_REQUEST, "COMPILER_FLAG_REJECTED", "rejected --auto"),
    ("NCC_E code, exit 70", Evidence(["ERROR [NCC_EVRF007] verifier failed on op %add.3"], 70), "ncc-error-code",
     ErrorClass.COMPILE, "NCC_EVRF007", "[NCC_EVRF007] verifier failed"),
    ("NCC_E code, exit 1", Evidence(["Traceback ...", NCC_OOM, "RuntimeError: neuronx-cc failed with 1"], 1),
     "ncc-error-code", ErrorClass.COMPILE, "NCC_EOOM001", "Estimated peak HBM"),
    ("NCC_EARG is a code, not a rejected flag", Evidence(["[NCC_EARG001] Unsupported Logical Neuron Core "
                                                          "configuration", "error: argument --lnc: invalid"], 70),
     "ncc-error-code", ErrorClass.COMPILE, "NCC_EARG001", "Logical Neuron Core"),
    ("NCC_I internal code, exit 70", Evidence([NCC_INTERNAL], 70), "ncc-internal-code", ErrorClass.COMPILE,
     "NCC_IXCG856", "[NCC_IXCG856] MATCH_REPLACE8"),
    ("NCC_I via trace", Evidence([NCC_INTERNAL, "RuntimeError: neuronx-cc failed with 70"], 70,
                                 exception=RUNTIME), "ncc-internal-code", ErrorClass.COMPILE, "NCC_IXCG856", ""),
    # compiler release notes (2.29.0): "NCC_CFG015 … stack overflow in control flow graph validation".
    ("NCC_CFG code, exit 70", Evidence(["2026-04-09T10:00:00Z ERROR 9 [neuronx-cc]: [NCC_CFG015] Control flow "
                                        "graph validation failed"], 70),
     "ncc-cfg-code", ErrorClass.COMPILE, "NCC_CFG015", "[NCC_CFG015] Control flow graph"),
    ("NCC_CFG is a code, not a rejected flag", Evidence(["[NCC_CFG015] validation", "error: argument --x: invalid"],
                                                        70),
     "ncc-cfg-code", ErrorClass.COMPILE, "NCC_CFG015", "validation"),
    ("the wrapper's log tag is no code", Evidence(["INFO ||NCC_WRAPPER||: Compile cache path: /var/tmp/c"], 1),
     "unknown", ErrorClass.UNKNOWN, "COMPILER_FAILED", "no error code"),
    ("bare TEN404 behind the wrapper", Evidence([BARE_TEN404], 70), "bare-code", ErrorClass.COMPILE, "TEN404",
     "[TEN404] (aten__add_add.31237) Internal tensorizer error"),
    ("bare XTP002", Evidence(["ERROR: [XTP002] tensor parallel layout not supported"], 1), "bare-code",
     ErrorClass.COMPILE, "XTP002", "[XTP002]"),
    ("bare F134", Evidence(["[F134] neuronx-cc terminated abnormally - Please open a support ticket"], 1),
     "bare-code", ErrorClass.COMPILE, "F134", "terminated abnormally"),
    # neuron-framework-autoport.rst, "Compilation failures": a corrupt persistent-cache entry; delete and retry.
    ("corrupt compile cache, bare NLA001", Evidence([CORRUPT_CACHE], None, exception=RUNTIME),
     "corrupt-compile-cache", ErrorClass.INFRA, "COMPILE_CACHE_CORRUPT", "json.exception.parse_error.101"),
    ("corrupt compile cache, NCC_ code", Evidence(["[INTERNAL_ERROR] " + CORRUPT_CACHE.replace("[NLA001]",
                                                   "[NCC_INLA001]")], 70),
     "corrupt-compile-cache", ErrorClass.INFRA, "COMPILE_CACHE_CORRUPT", "parse_error"),
    ("NLA001 without a parse error is still the compiler's", Evidence(["[NLA001] Unhandled exception with "
                                                                       "message: boom"], 70),
     "bare-code", ErrorClass.COMPILE, "NLA001", "[NLA001]"),
    ("torch [W…] warning prefixes are no bare code", Evidence(["[W1203 10:23:45.12 init.cpp:12] warning"], 1),
     "unknown", ErrorClass.UNKNOWN, "COMPILER_FAILED", "no error code"),
    ("lowering error raised in trace", Evidence([LOWERING], None, exception=RUNTIME), "unsupported-operator",
     ErrorClass.COMPILE, "UNSUPPORTED_OPERATOR", "Error while lowering"),
    ("unsupported operator from the CLI", Evidence(["ERROR: Unsupported operator: aten::_fft_r2c"], 1),
     "unsupported-operator", ErrorClass.COMPILE, "UNSUPPORTED_OPERATOR", "aten::_fft_r2c"),
    ("neuronx-cc's operator hint", Evidence(["Please consider implementing the deep learning model or training "
                                             "loop using supported XLA operators only."], 1),
     "unsupported-operator", ErrorClass.COMPILE, "UNSUPPORTED_OPERATOR", "supported XLA operators"),
    ("an infra exception mentioning an operator is not one", Evidence(["unsupported op aten::foo"], None,
                                                                       exception=("KeyError", "LookupError")),
     "unknown", ErrorClass.UNKNOWN, "COMPILER_FAILED", "failed and printed no error code"),
    ("exit 70 without a code", Evidence(["Internal compiler error: please open a support ticket"], 70,
                                        unknown_code="NEURONX_CC_EXIT_70"),
     "unknown", ErrorClass.UNKNOWN, "NEURONX_CC_EXIT_70", "failed with 70 and printed no error code"),
    ("exit 1 without a code", Evidence([], 1, unknown_code="NEURONX_CC_EXIT_1"), "unknown", ErrorClass.UNKNOWN,
     "NEURONX_CC_EXIT_1", "no output"),
    ("a Python exception in trace with no evidence", Evidence(["KeyError: 'x'"], None, exception=("KeyError",),
                                                              who="torch_neuronx.trace",
                                                              unknown_code="NEURON_TRACE_FAILED"),
     "unknown", ErrorClass.UNKNOWN, "NEURON_TRACE_FAILED", "torch_neuronx.trace failed"),
]


@pytest.mark.parametrize(("evidence", "row", "error_class", "code", "part"), [c[1:] for c in JUDGE_CASES],
                         ids=[c[0] for c in JUDGE_CASES])
def test_judge(evidence: Evidence, row: str, error_class: ErrorClass, code: str, part: str) -> None:
    verdict = judge(evidence)
    assert (verdict.row, verdict.error_class, verdict.code) == (row, error_class, code), verdict
    assert part in verdict.message
    assert "\n" not in verdict.message and len(verdict.message) <= MAX_MESSAGE


def test_every_row_has_a_case_a_source_and_a_doc_entry() -> None:
    names = [row.name for row in TABLE]
    assert len(set(names)) == len(names) and names[-1] == "unknown"
    assert {case[2] for case in JUDGE_CASES} == set(names)
    docs = (REPO / "docs" / "neuron-hosts.md").read_text()
    section = docs[docs.index("## How failures are classified"):]
    for row in TABLE:
        assert row.source and row.evidence
        assert f"`{row.name}`" in section, f"row {row.name} is missing from docs/neuron-hosts.md"


# Every code family of the SDK's error-code pages (aws-neuron-sdk compiler/error-codes/*.rst: NCC_E + ARG, BIR,
# BVF, HCA, MOD, OOM, SFH, SPP, UOC, VRF, XSP, XTP) and of the compiler release notes (NCC_ESMP002 in 2.29.0;
# NCC_CFG015 in 2.29.0; internal NCC_IBIR229, NCC_ILIN902, NCC_IBIR182 in 2.30.0, NCC_IRPX902 in 2.32.0,
# NCC_INLA001 in 2.29.0): one example code each, printed the way the compiler prints it.
DOCUMENTED_CODES = ["NCC_EARG001", "NCC_EBIR023", "NCC_EBVF030", "NCC_EHCA005", "NCC_EMOD025", "NCC_EOOM002",
                    "NCC_ESFH002", "NCC_ESPP047", "NCC_EUOC002", "NCC_EVRF065", "NCC_EXSP001", "NCC_EXTP004",
                    "NCC_ESMP002", "NCC_CFG015", "NCC_IBIR229", "NCC_ILIN902", "NCC_IRPX902", "NCC_INLA001"]


@pytest.mark.parametrize("code", DOCUMENTED_CODES)
def test_every_documented_code_family_is_a_compile_error(code: str) -> None:
    line = (f"[INTERNAL_ERROR] [{code}] Unhandled exception with message: boom" if code.startswith("NCC_I")
            else f"[{code}] the documented message")
    verdict = judge(Evidence([f"2026-08-17T10:00:00Z ERROR 9 [neuronx-cc]: {line}"], 70))
    assert (verdict.error_class, verdict.code) == (ErrorClass.COMPILE, code), verdict


def test_code_families_name_their_source_and_cover_the_documented_codes() -> None:
    assert {family.prefix for family in CODE_FAMILIES} >= {"NCC_E", "NCC_I", "NCC_CFG"}
    for family in CODE_FAMILIES:
        assert family.source and family.meaning and family.row in {row.name for row in TABLE}
    for code in DOCUMENTED_CODES:
        assert any(code.startswith(family.prefix) for family in CODE_FAMILIES), code


# The compiler release notes of 2.30.0 and 2.31.0 fixed "non-deterministic compilation failures caused by data
# races in control flow validation"; the code of control flow graph validation is NCC_CFG… (2.29.0 notes).
@pytest.mark.parametrize(("code", "sdk", "suspect"), [
    ("NCC_CFG015", "2.27.1", True), ("NCC_CFG015", "2.30.0", True), ("NCC_CFG015", "2.31.0", False),
    ("NCC_CFG015", "2.32.0", False), ("NCC_EVRF007", "2.27.1", False), ("NCC_INLA001", "2.27.1", False),
])
def test_codes_the_release_notes_call_non_deterministic(code: str, sdk: str, suspect: bool) -> None:
    reason = nondeterministic(code, sdk)
    assert (reason is not None) == suspect
    if reason is not None:
        assert "2.31.0" in reason and "non-deterministic" in reason


def test_a_suspect_compile_error_is_marked_for_one_retry_only_on_affected_releases() -> None:
    failed = Outcome(ErrorClass.COMPILE, "NCC_CFG015", "[NCC_CFG015] Control flow graph validation failed")
    assert for_release(failed, "2.27.1").retry_once is not None
    assert for_release(failed, "2.31.0").retry_once is None
    unknown = Outcome(ErrorClass.UNKNOWN, "NCC_CFG015", "x")  # only a compile error is ever made final by a code
    assert for_release(unknown, "2.27.1").retry_once is None


def compile_error(code: str, message: str = "boom") -> dict[str, Any]:
    return {"status": "compile_error", "code": code, "message": message}


# id, returncode, result, log tail, timed_out, cancelled, expected error_class, expected code, message part
CASES: list[tuple[str, int, dict[str, Any] | None, list[str], bool, bool, str | None, str | None, str]] = [
    ("success", 0, OK, ["[compile-child] ok"], False, False, None, None, "ok"),
    ("success with noise in the log", 0, OK, [NUMPY_WARNING, NCC_OOM], False, False, None, None, "ok"),
    ("exit 0 without result", 0, None, [], False, False, "infra", "PROTOCOL", "missing"),
    ("exit 0 with compile_error result", 0, compile_error("X"), [], False, False, "infra", "PROTOCOL", "compile_error"),
    ("child compile error", 3, compile_error("CPU_TRACE_ERROR", "shape mismatch"), [NUMPY_WARNING], False, False,
     "compile", "CPU_TRACE_ERROR", "shape mismatch"),
    ("child rejected flag", 5, {"status": "bad_request", "code": "COMPILER_FLAG_REJECTED", "message": "--x"}, [],
     False, False, "bad_request", "COMPILER_FLAG_REJECTED", "--x"),
    ("child infra_error result", 4, {"status": "infra_error", "code": "WRONG_HOST", "message": "isa"}, [], False,
     False, "infra", "WRONG_HOST", "isa"),
    ("child unknown_error result", 6, {"status": "unknown_error", "code": "NEURONX_CC_EXIT_70", "message": "70"},
     [], False, False, "unknown", "NEURONX_CC_EXIT_70", "70"),
    ("NCC code in the log, no result", 1, None, ["Traceback ...", NCC_OOM, "RuntimeError: neuronx-cc failed with 1"],
     False, False, "compile", "NCC_EOOM001", "[NCC_EOOM001] Estimated peak HBM"),
    ("exit 3, result lost, own log line", 3, None, ["[compile-child] compile error CPU_EXPORT_ERROR: guard failed"],
     False, False, "compile", "CPU_EXPORT_ERROR", "guard failed"),
    ("SIGKILL, silent log", -9, None, ["[compile-child] start", NUMPY_WARNING], False, False, "infra", "SIGKILL",
     "possibly OOM-killed"),
    ("SIGKILL after an NCC code", -9, None, [NCC_OOM], False, False, "infra", "SIGKILL", "killed by SIGKILL"),
    ("SIGKILL with host OOM in the log", -9, None, ["Out of memory: Killed process 4242 (python)"], False, False,
     "infra", "SIGKILL", "HOST_OOM"),
    ("SIGTERM with a compile_error result", -15, compile_error("X"), [], False, False, "infra", "SIGTERM",
     "SIGTERM"),
    ("missing shared library, no result", 127, None, ["x: error while loading shared libraries: libz.so.1"], False,
     False, "infra", "SHARED_LIBRARY", "libz.so.1"),
    ("child crash with no evidence is unknown", 1, None, ["Traceback (most recent call last):", "KeyError: 'x'"],
     False, False, "unknown", "EXIT_1", "KeyError: 'x'"),
    ("child crash on an OSError", 1, None, ["Traceback (most recent call last):", '  File "x.py", line 1',
                                            "    os.mkdir(p)", "FileExistsError: [Errno 17] File exists: 'o'"],
     False, False, "infra", "HOST_OS_ERROR", "File exists"),
    ("unknown exit, no output", 2, None, [], False, False, "unknown", "EXIT_2", "no output"),
    ("shell-style signal exit", 137, None, [], False, False, "unknown", "EXIT_137", "SIGKILL"),
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
    assert "\n" not in outcome.message and len(outcome.message) <= MAX_MESSAGE


@pytest.mark.parametrize(("error_class", "ok", "retryable"), [
    (None, True, False), ("compile", False, False), ("bad_request", False, False), ("cancelled", False, False),
    ("infra", False, True), ("timeout", False, True), ("unknown", False, True),
])
def test_outcome_flags(error_class: Any, ok: bool, retryable: bool) -> None:
    outcome = Outcome(error_class, None, "")
    assert (outcome.ok, outcome.retryable) == (ok, retryable)


def test_messages_are_one_bounded_line() -> None:
    outcome = classify(1, None, ["x" * 9000 + "\n" + "y"], False, False)
    assert len(outcome.message) == MAX_MESSAGE and "\n" not in outcome.message
    assert outcome.message.startswith("the compile child failed with 1") and outcome.message.endswith("x y")


# -- long messages: the bound, and the head and tail kept around the cut -----------------------------------

def test_a_message_within_the_bound_is_kept_whole() -> None:
    text = "e" * MAX_MESSAGE
    assert shorten(text) == text and one_line(text) == text
    assert MAX_MESSAGE == 4000 and MAX_MESSAGE_CHARS == MAX_MESSAGE  # one bound: result.json and the ledger


def test_a_long_message_keeps_its_head_and_its_tail() -> None:
    head, middle, tail = "H" * 2000, "m" * 5000, "T" * 3000
    cut = shorten(head + middle + tail)
    assert len(cut) == MAX_MESSAGE and cut.count(CUT_MARK) == 1
    kept_head, kept_tail = cut.split(CUT_MARK)
    assert (len(kept_head), len(kept_tail)) == (1332, 2665)  # a third, two thirds of what the mark leaves
    assert kept_head == "H" * 1332 and kept_tail == "T" * 2665
    assert shorten("abcdefghij", 8) == "a … ghij" and shorten("abcdefghij", 4) == "abcd"


def test_the_compilers_error_after_a_long_traceback_survives() -> None:
    frames = [f'  File "/venv/torch/_inductor/mod{i}.py", line {i}, in f{i}\n    call_{i}()' for i in range(300)]
    text = "\n".join(["torch.jit.trace failed: Traceback (most recent call last):", *frames,
                      "RuntimeError: shape '[2, 32]' is invalid for input of size 96"])
    message = CompileFailure("CPU_TRACE_ERROR", text).message
    assert len(message) == MAX_MESSAGE and "\n" not in message
    assert message.startswith("torch.jit.trace failed: Traceback (most recent call last):")
    assert message.endswith("call_299() RuntimeError: shape '[2, 32]' is invalid for input of size 96")
    failure = CompileFailure("CPU_TRACE_ERROR", text)
    assert failure.full_text == text  # the child logs it whole (workers.backends.compile_child)
    outcome = classify(3, {"status": "compile_error", "code": "CPU_TRACE_ERROR", "message": message}, [], False,
                       False)
    assert outcome.message == message


def test_an_unknown_crash_quotes_what_was_raised_not_a_multi_line_messages_last_line() -> None:
    tail = ["Traceback (most recent call last):", '  File "/w/run.py", line 3, in <module>', "    go()",
            "torch._dynamo.exc.Unsupported: data-dependent branching", "", "from user code:",
            '   File "/w/model.py", line 9, in forward', "    if x.sum() > 0:"]
    outcome = classify(1, None, tail, False, False)
    assert (outcome.error_class, outcome.code) == ("unknown", "EXIT_1")
    assert outcome.message == ("the compile child failed with 1 and printed no error code or other evidence; "
                               "raised torch._dynamo.exc.Unsupported: data-dependent branching; "
                               "last output: if x.sum() > 0:")
