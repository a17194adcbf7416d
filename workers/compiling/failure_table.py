"""The classification table: which evidence of a failed compile means which error class, and where that is said.

Owns :data:`TABLE`, the one place that maps a compiler failure to an error class; each row says what
evidence it needs and cites where that evidence comes from (docs/neuron-hosts.md, "How failures are
classified", shows the same rows), and :class:`Evidence`, what the rows read. The patterns the rows share are
in :mod:`workers.compiling.failure_text`; applying the table (the first row whose evidence is present, its
message) is :func:`workers.compiling.classify.judge`. Data and pure functions; imports nothing heavy.

Principles:

- **The code beats the exit status.** neuronx-cc exits 70 for ordinary, repeatable compile failures as well
  as for the odd transient one (REFERENCE: aws-neuron-sdk#947, #1369): exit 70 with an ``NCC_…`` code is a
  compile error, exit 70 without one says nothing and is *unknown*.
- **A broken host never fails a key for good.** Rows that show the compiler never ran or could not finish
  (a missing shared library, a signal, a full disk, host memory) come before the compiler's codes.
- **No evidence, no verdict.** What matches no row is *unknown*: retried a bounded number of times
  (``unknown_failure_retries``, :func:`compilesvc.compiles.leases.fail`), then reported as unknown; never cached.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from compilesvc.states import ErrorClass
from workers.compiling.failure_text import (
    ANY_NCC_RE,
    BARE_CODE_RE,
    NCC_CFG_RE,
    NCC_ERROR_RE,
    NCC_INTERNAL_RE,
    OS_ERROR_RE,
    REJECTED_FLAG_RE,
)

#: Exceptions a trace raises for an operator it cannot lower (torch-xla: RuntimeError "Error while lowering";
#: torch_neuronx: RuntimeError "neuronx-cc failed with N" around the compiler's own message).
OPERATOR_EXCEPTIONS = frozenset({"RuntimeError", "NotImplementedError"})

#: The row for a corrupt persistent-cache entry (the Neuron backend removes the cache when it decides).
CORRUPT_CACHE_ROW = "corrupt-compile-cache"
#: The row for neuronx-cc's F137, killed for want of host memory.
F137_ROW = "compiler-out-of-host-memory"


@dataclass(frozen=True)
class Evidence:
    """What is known about one failed compiler run.

    ``status``: the compiler's exit status (negative: killed by that signal; None: unknown, e.g. a Python
    exception in trace before the compiler ran). ``exception``: the names in the raised exception's class
    hierarchy (trace path), empty for a command line. ``who`` names the failing tool in messages;
    ``unknown_code`` is the code an unexplained failure is reported under.
    """

    lines: Sequence[str]
    status: int | None
    exception: tuple[str, ...] = ()
    who: str = "neuronx-cc"
    unknown_code: str = "COMPILER_FAILED"


@dataclass(frozen=True)
class Row:
    """One row of the table: the first row whose evidence is present decides.

    Evidence is a line of output matching ``pattern`` (lines carrying a user-facing ``NCC_E…`` code are
    skipped when ``skip_coded_lines``: ``NCC_EOOM…`` is the device's memory, not the host's; an internal
    ``NCC_I…`` code is not a reason to skip, because the driver prints every unhandled exception behind
    one: ``[INTERNAL_ERROR] [NCC_INLA001] Unhandled exception with message: [Errno 28] No space left on
    device``), or an exception whose hierarchy holds one of ``exceptions``, or ``applies`` being true;
    ``applies`` also gates the others.
    """

    name: str
    error_class: ErrorClass
    code: str  # "{code}": the code the match captured
    evidence: str  # for the docs table
    source: str
    pattern: re.Pattern[str] | None = None
    exceptions: frozenset[str] = field(default_factory=frozenset)
    applies: Callable[[Evidence], bool] | None = None
    skip_coded_lines: bool = False


def _killed(evidence: Evidence) -> bool:
    return evidence.status is not None and evidence.status < 0


def _not_an_infra_exception(evidence: Evidence) -> bool:
    return not evidence.exception or bool(OPERATOR_EXCEPTIONS.intersection(evidence.exception))


E = ErrorClass
#: The classification table, in the order it is read. Sources: REFERENCE is /work/shared/REFERENCE.md's
#: "Neuron compiler facts"; issue numbers are github.com/aws-neuron/aws-neuron-sdk unless named otherwise.
TABLE: tuple[Row, ...] = (
    Row("missing-shared-library", E.INFRA, "SHARED_LIBRARY",
        "'error while loading shared libraries' / 'cannot open shared object file', any exit",
        "the dynamic loader's messages (ld.so(8), dlopen(3)): the compiler never ran, so any code near them "
        "is no verdict on the model",
        pattern=re.compile(r"error while loading shared libraries|cannot open shared object file")),
    Row("killed-by-signal", E.INFRA, "COMPILER_KILLED",
        "killed by a signal: negative status, or trace's RuntimeError('neuronx-cc failed with -9')",
        "REFERENCE (OOM-killed compiles surface as 'neuronx-cc failed with -9'); subprocess returncode "
        "convention: the compile did not finish",
        applies=_killed),
    Row(F137_ROW, E.INFRA, "HOST_OOM",
        "neuronx-cc's '[F137] neuronx-cc was forcibly killed … insufficient system memory', any exit (usually 70)",
        "the neuronx-cc driver's fatal-exit text (aws-neuron-samples#64; docs/research/nxdi.md §6, exit 70): the host "
        "ran out of memory for the compiler, not the model's fault; read before 'bare-code', which would take "
        "[F137] for a compile error. The message names the memory (:func:`memory_words`)",
        pattern=re.compile(r"\[F137\]|neuronx-cc was forcibly killed")),
    Row("disk-full", E.INFRA, "DISK_FULL", "'No space left on device' (ENOSPC), any exit",
        "errno ENOSPC's message (strerror(3)): the host's disk, not the model", skip_coded_lines=True,
        pattern=re.compile(r"No space left on device")),
    Row("host-out-of-memory", E.INFRA, "HOST_OOM",
        "MemoryError, 'Cannot allocate memory', std::bad_alloc, kernel OOM-killer lines",
        "Python's MemoryError, errno ENOMEM, C++ std::bad_alloc, the kernel's 'Out of memory: Kill' log: "
        "host memory (the device's HBM is NCC_EOOM…, a compile error)", skip_coded_lines=True,
        pattern=re.compile(r"^\s*MemoryError\b|Cannot allocate memory|can't allocate memory|std::bad_alloc|"
                           r"Out of memory: Kill|oom-kill", re.IGNORECASE),
        exceptions=frozenset({"MemoryError"})),
    Row("missing-module", E.INFRA, "MISSING_MODULE",
        "a traceback ending in ImportError / ModuleNotFoundError (not a warning that mentions a module), also "
        "as the cause of trace's exception; trace's 'neuronx-cc compiler binary does not exist'",
        "Python's import system: a package missing on this worker (#714: an SDK console script dying on import; "
        "huggingface/optimum-neuron#68: trace re-raises a failed `import neuronxcc` as RuntimeError); #737: "
        "trace's RuntimeError when the neuronx-cc binary is missing",
        skip_coded_lines=True,
        pattern=re.compile(r"^\s*(?:[\w.]+\.)?(?:ModuleNotFoundError|ImportError)\b|"
                           r"neuronx-cc compiler binary does not exist"),
        exceptions=frozenset({"ImportError"})),
    Row("host-os-error", E.INFRA, "HOST_OS_ERROR",
        "trace raised an OSError, or the output shows one: 'XxxError: [Errno N] …' (a traceback's last line) or "
        "the compiler's 'Unhandled exception with message: [Errno N] …' (I/O, permissions, a vanished file)",
        "Python's OSError family, whose str() is '[Errno N] strerror: path': the host's files and devices, not "
        "the model; neuronx-cc's driver reports any unhandled exception as '[NLA001] / [INTERNAL_ERROR] "
        "[NCC_INLA001] Unhandled exception with message: <str(exc)>' (#1118, #948, #1314)",
        skip_coded_lines=True, pattern=OS_ERROR_RE, exceptions=frozenset({"OSError"})),
    Row(CORRUPT_CACHE_ROW, E.INFRA, "COMPILE_CACHE_CORRUPT",
        "'[NLA001]' / '[NCC_INLA001]' around nlohmann::json's 'json.exception.parse_error', any exit",
        "aws-neuron-sdk tools/neuron-agentic-development/developer_guides/neuron-framework-autoport.rst ('JSON parse "
        "error ([NLA001] Unhandled exception with message: [json.exception.parse_error.101]). Delete the compiler "
        "cache … and retry'): an unreadable persistent-cache entry, not the model; the backend removes the "
        "compile's cache (workers/backends/neuron_cache.py) and the attempt is retried",
        pattern=re.compile(r"\[(?:NCC_I)?NLA001\].*json\.exception\.parse_error")),
    Row("rejected-flag", E.BAD_REQUEST, "COMPILER_FLAG_REJECTED",
        "the argument parser's 'error: unrecognized arguments: …' / 'argument --x: invalid choice' / "
        "'expected one argument' / 'ambiguous option', no NCC code",
        "Python argparse's wording (docs.python.org/3/library/argparse.html); neuronx-cc's driver is Python "
        "(neuronxcc/driver/CommandDriver.py in the tracebacks of #806) and its usage message is argparse's "
        "(neuronx-cc 2.5.0.28 release notes). The exact text of the real compiler is unverified: if it differs, "
        "the failure falls to 'unknown' (bounded retries), never to a compile error",
        pattern=REJECTED_FLAG_RE, applies=lambda e: not any(ANY_NCC_RE.search(line) for line in e.lines)),
    Row("ncc-error-code", E.COMPILE, "{code}", "an NCC_E… code in the output, any exit (usually 70)",
        "neuronx-cc error codes (Neuron docs, compiler/error-codes: NCC_EARG001, NCC_EOOM001, …); REFERENCE: "
        "exit 70 with a code is a repeatable compile failure",
        pattern=NCC_ERROR_RE),
    Row("ncc-internal-code", E.COMPILE, "{code}", "'[INTERNAL_ERROR] [NCC_I…]' in the output, exit 70",
        "#947, #1303 (NCC_IXCG856, repeatable per model), #1314 (NCC_INLA001): internal codes mark the "
        "compiler failing on this graph, every time",
        pattern=NCC_INTERNAL_RE),
    Row("ncc-cfg-code", E.COMPILE, "{code}", "an NCC_CFG… code in the output, any exit (usually 70)",
        "aws-neuron-sdk release-notes/components/compiler.rst, 2.29.0 ('NCC_CFG015 … stack overflow in control "
        "flow graph validation'). Before 2.31.0 such a failure may not recur: see error_codes.NONDETERMINISTIC",
        pattern=NCC_CFG_RE),
    Row("bare-code", E.COMPILE, "{code}", "a bare bracketed pre-2.2x code: [XTP002], [TEN404], [F134]",
        "#947 ('[TEN404] … Internal tensorizer error'), #1000 ('[F134] neuronx-cc terminated abnormally'), "
        "REFERENCE ([XTP002])",
        pattern=BARE_CODE_RE),
    Row("unsupported-operator", E.COMPILE, "UNSUPPORTED_OPERATOR",
        "no code; 'Error while lowering:' (torch-xla), \"Could not run 'aten::…' with arguments from the 'XLA' "
        "backend\" (the dispatcher), 'Unsupported operator', 'supported XLA operators only' (neuronx-cc), raised "
        "as RuntimeError / NotImplementedError in trace or printed by the CLI",
        "pytorch/xla#9707, #2897 ('RuntimeError: Error while lowering: … aten::…'); pytorch/xla#9725 "
        "(NotImplementedError: Could not run 'aten::…' with arguments from the 'XLA' backend); "
        "#588 (neuronx-cc: 'Please consider implementing the deep learning model … using supported XLA "
        "operators only'); REFERENCE: "
        "deterministic for the model. Any other exception type (ImportError, MemoryError, OSError, …) is "
        "never read as this row",
        pattern=re.compile(r"Error while lowering:|Could not run '[\w:.]+' with arguments from the 'XLA' backend|"
                           r"\bunsupported\s+(?:operator|op)\b|supported XLA operators only", re.IGNORECASE),
        applies=_not_an_infra_exception),
    Row("unknown", E.UNKNOWN, "{unknown}", "anything else: a nonzero exit or an exception with none of the above",
        "no evidence: retried unknown_failure_retries times (compilesvc/config/settings.py), then final as 'unknown'; "
        "never negatively cached",
        applies=lambda e: True),
)
del E

