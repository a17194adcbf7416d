"""Classifying a failed compile by evidence: what the compiler printed and how it ended decide its class.

Owns :data:`TABLE`, the one place that maps a compiler failure to an error class; each row says what
evidence it needs and cites where that evidence comes from (docs/neuron-hosts.md, "How failures are
classified", shows the same rows). The Neuron backend applies it in the compile child (:func:`judge`, for
a failed ``neuronx-cc`` run or ``torch_neuronx.trace`` call); the runner applies it to the log of a child
that died without a result, after its own rules (:func:`classify`). Pure functions; imports nothing heavy.

Principles:

- **The code beats the exit status.** neuronx-cc exits 70 for ordinary, repeatable compile failures as well
  as for the odd transient one (REFERENCE: aws-neuron-sdk#947, #1369): exit 70 with an ``NCC_…`` code is a
  compile error, exit 70 without one says nothing and is *unknown*.
- **A broken host never fails a key for good.** Rows that show the compiler never ran or could not finish
  (a missing shared library, a signal, a full disk, host memory) come before the compiler's codes.
- **No evidence, no verdict.** What matches no row is *unknown*: retried a bounded number of times
  (``unknown_failure_retries``, :func:`compilesvc.compiles.leases.fail`), then reported as unknown; never cached.

Runner rules before the table (:func:`classify`): cancelled -> ``cancelled``; timed out -> ``timeout``;
exit 0 with an ``ok`` result -> success, without one -> infra ``PROTOCOL``; child killed by a signal ->
infra (the compile did not finish, whatever its log says); a result.json from the child -> its class (the
child already applied the table, or raised a worker problem itself: wrong host or SDK, package missing).
"""

from __future__ import annotations

import builtins
import re
import resource
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compilesvc.hostinfo import host_memory_bytes
from compilesvc.states import RETRIED, ErrorClass
from workers.compiling.contract import one_line

#: neuronx-cc's user-facing codes, NCC_E + component + digits (NCC_EOOM001, NCC_EVRF007, NCC_EARG001).
NCC_ERROR_RE = re.compile(r"\b(NCC_E[A-Z]{2,6}\d{1,4})\b")
#: Internal codes, printed as ``[INTERNAL_ERROR] [NCC_INLA001] …`` (NCC_IXCG856, NCC_ITEN404).
NCC_INTERNAL_RE = re.compile(r"\b(NCC_I[A-Z]{2,6}\d{1,4})\b")
#: Control flow graph validation's codes (compiler release notes, 2.29.0: "NCC_CFG015 … stack overflow in control
#: flow graph validation"): no E/I letter.
NCC_CFG_RE = re.compile(r"\b(NCC_CFG\d{1,4})\b")
ANY_NCC_RE = re.compile(r"\bNCC_(?:[EI][A-Z]{2,6}|CFG)\d{1,4}\b")
#: Codes of compilers before 2.2x, bare and bracketed: ``[XTP002]``, ``[TEN404]``, ``[F134]``.
BARE_CODE_RE = re.compile(r"\[([A-Z]{1,4}\d{3,4})\]")
#: The child's own log line for a compile error (workers.backends.compile_child).
CHILD_COMPILE_ERROR_RE = re.compile(r"\[compile-child\] compile error (\S+): (.*)")
#: An argument parser refusing the command line: argparse's wording, which a Python CLI such as neuronx-cc's
#: driver prints as ``neuronx-cc compile: error: …`` (exit 2). Group ``flag`` names the rejected flag.
REJECTED_FLAG_RE = re.compile(
    r"\berror: (?:unrecognized arguments: (?P<flags>.+)"
    r"|argument (?P<flag>[^\s:]+(?:/[^\s:]+)*): (?:invalid|expected|ignored explicit|not allowed)"
    r"|ambiguous option: (?P<ambiguous>[^\s=]+))")
#: Exceptions a trace raises for an operator it cannot lower (torch-xla: RuntimeError "Error while lowering";
#: torch_neuronx: RuntimeError "neuronx-cc failed with N" around the compiler's own message).
OPERATOR_EXCEPTIONS = frozenset({"RuntimeError", "NotImplementedError"})
#: An OSError's text where an exception is reported: a traceback's "PermissionError: [Errno 13] …" or the
#: compiler driver's "Unhandled exception with message: [Errno 5] …".
OS_ERROR_RE = re.compile(r"(?:\b[A-Z]\w*Error|Unhandled exception with message):\s*\[Errno \d+\]")
#: A traceback's last line: an unindented exception name, then ": message" or nothing.
_EXCEPTION_LINE_RE = re.compile(r"^([A-Za-z_][\w.]*)(?::|\s*$)")


#: The row for a corrupt persistent-cache entry (the Neuron backend removes the cache when it decides).
CORRUPT_CACHE_ROW = "corrupt-compile-cache"
#: The row for neuronx-cc's F137, killed for want of host memory.
F137_ROW = "compiler-out-of-host-memory"
#: The setting bounding each compile's memory (compilesvc/config/settings.py sandbox_memory_mb), named in messages.
MEMORY_SETTING = "COMPILESVC_SANDBOX_MEMORY_MB"


def _gib(size: int) -> str:
    return f"{size / 1024**3:.1f} GiB"


def memory_words() -> str:
    """The memory a compile had, in words, for a failure that says memory ran out: the host's (or its cgroup's,
    :func:`compilesvc.hostinfo.host_memory_bytes`) and this process's address-space bound (RLIMIT_AS: the
    sandbox's ``COMPILESVC_SANDBOX_MEMORY_MB``)."""
    words = []
    total = host_memory_bytes()
    if total:
        words.append(f"this worker's host has {_gib(total)} of memory")
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        words.append(f"each compile process may map {_gib(soft)} ({MEMORY_SETTING})")
    else:
        words.append(f"{MEMORY_SETTING} bounds each compile's memory")
    return "; ".join(words)


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
class Verdict:
    error_class: ErrorClass
    code: str
    message: str
    row: str  # the name of the row of TABLE that decided


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


def _last_line(lines: Sequence[str]) -> str:
    for line in reversed(lines):
        if line.strip():
            return one_line(line)
    return ""


def _raised_line(lines: Sequence[str]) -> str | None:
    """The exception line of the last traceback in ``lines`` (``KeyError: 'x'``), or None.

    A Python traceback ends with the exception's name and message, but a message may run on over lines
    (torch's dynamo errors add "from user code:" and a stack; CppCompileError prints the command, then the
    compiler's output): the first unindented line after the frames is what was raised.
    """
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if _EXCEPTION_LINE_RE.match(line):
            return line
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _from_code_on(line: str, match: re.Match[str]) -> str:
    """The line from the code on: the timestamp/pid/logger prefix is noise in a one-line message."""
    start = match.start()
    if start > 0 and line[start - 1] == "[":
        start -= 1
    return one_line(line[start:])


def _rejected_flag(match: re.Match[str]) -> str:
    flags = match.group("flags") or match.group("flag") or match.group("ambiguous") or ""
    return flags.strip()


def _find(row: Row, evidence: Evidence) -> tuple[str, re.Match[str] | None] | None:
    """The line (and match) that is this row's evidence, or None."""
    if row.applies is not None and not row.applies(evidence):
        return None
    if row.pattern is not None:
        for line in evidence.lines:
            if row.skip_coded_lines and NCC_ERROR_RE.search(line):
                continue
            match = row.pattern.search(line)
            if match:
                return line, match
    if row.exceptions and row.exceptions.intersection(evidence.exception):
        return _last_line(evidence.lines), None
    if row.pattern is None and not row.exceptions:
        return _last_line(evidence.lines), None
    return None


def _message(row: Row, evidence: Evidence, line: str, match: re.Match[str] | None) -> str:
    status = evidence.status
    last = _last_line(evidence.lines)
    if row.name == F137_ROW:
        return one_line(f"{evidence.who} ran out of host memory: {line.strip()} ({memory_words()})")
    if row.name == "killed-by-signal" and status is not None:
        name = _signal_name(-status)
        why = f" (possibly OOM-killed: {memory_words()})" if -status == signal.SIGKILL else ""
        return f"{evidence.who} was killed by {name}{why}" + (f"; last output: {last}" if last else "")
    if row.name == "rejected-flag" and match is not None:
        return one_line(f"the compiler rejected {_rejected_flag(match)}: {line.strip()}")
    if row.name == "unknown":
        ended = f"failed with {status}" if status is not None else "failed"
        # What was raised says more than a multi-line message's last line; quote both when they differ.
        raised = _raised_line(evidence.lines)
        said = ("; no output" if not last else f"; last output: {last}" if raised is None or one_line(raised) == last
                else f"; raised {raised.strip()}; last output: {last}")
        return one_line(f"{evidence.who} {ended} and printed no error code or other evidence{said}")
    if match is not None and row.code == "{code}":
        return _from_code_on(line, match)
    return one_line(line) if line else row.code


def judge(evidence: Evidence) -> Verdict:
    """The verdict of the first row of :data:`TABLE` whose evidence is present (the last row always is)."""
    for row in TABLE:
        found = _find(row, evidence)
        if found is None:
            continue
        line, match = found
        if row.code == "{code}" and match is not None:
            code = match.group(1)
        elif row.code == "{unknown}":
            code = evidence.unknown_code
        else:
            code = row.code
        return Verdict(row.error_class, code, _message(row, evidence, line, match), row.name)
    raise AssertionError("the table's last row matches everything")


# -- the runner's view of a finished compile child ------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """How a compile attempt ended. ``error_class`` None means success."""

    error_class: ErrorClass | None
    code: str | None
    message: str
    #: Why a compile error gets one more attempt before it is final (:mod:`workers.compiling.error_codes`).
    retry_once: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_class is None

    @property
    def retryable(self) -> bool:
        """Whether another attempt may follow (unknown failures only a bounded number of times)."""
        return self.error_class in RETRIED


#: result.json's ``status`` -> the error class the child found (workers.backends.compile_child).
RESULT_STATUSES: dict[str, ErrorClass] = {
    "compile_error": ErrorClass.COMPILE, "bad_request": ErrorClass.BAD_REQUEST,
    "infra_error": ErrorClass.INFRA, "unknown_error": ErrorClass.UNKNOWN,
}


def classify(returncode: int, result: dict[str, Any] | None, log_tail: list[str], timed_out: bool,
             cancelled: bool) -> Outcome:
    """Classify one compile child run (the runner's rules in the module docstring, then :data:`TABLE`).

    ``returncode`` is the child's (negative: killed by that signal), ``result`` its parsed
    ``result.json`` or None, ``log_tail`` the last lines of its combined stdout/stderr, ``timed_out``
    and ``cancelled`` whether the runner killed it for those reasons.
    """
    tail = [line.rstrip("\n") for line in log_tail]
    status = result.get("status") if isinstance(result, dict) else None
    last = _last_line(tail)

    if cancelled:
        return Outcome(ErrorClass.CANCELLED, "CANCELLED", "cancelled")
    if timed_out:
        return Outcome(ErrorClass.TIMEOUT, "TIMEOUT", one_line("time limit reached" + (
            f"; last output: {last}" if last else "; no output")))
    if returncode == 0:
        if status == "ok":
            return Outcome(None, None, "ok")
        return Outcome(ErrorClass.INFRA, "PROTOCOL",
                       f"exit 0 but result.json is {'missing' if result is None else repr(status)}")
    if returncode < 0:
        return _child_killed(-returncode, tail, last)
    if isinstance(result, dict) and status in RESULT_STATUSES:
        return Outcome(RESULT_STATUSES[str(status)], str(result.get("code") or str(status).upper()),
                       one_line(str(result.get("message") or f"exit {returncode}")))
    if returncode == 3:  # the child's own verdict, whose result.json went missing
        for line in reversed(tail):
            match = CHILD_COMPILE_ERROR_RE.search(line)
            if match:
                return Outcome(ErrorClass.COMPILE, match.group(1), one_line(match.group(2)))
    verdict = judge(Evidence(tail, returncode, exception=traceback_exception(tail), who="the compile child",
                             unknown_code=f"EXIT_{returncode}"))
    message = verdict.message
    if verdict.error_class == ErrorClass.UNKNOWN and 128 < returncode < 128 + 65:
        message = one_line(f"{message} (exit {returncode}: perhaps {_signal_name(returncode - 128)})")
    return Outcome(verdict.error_class, verdict.code, message)


def traceback_exception(lines: Sequence[str]) -> tuple[str, ...]:
    """The class hierarchy (for builtins; else just the name) of the exception the last traceback ends in."""
    line = _raised_line(lines)
    match = _EXCEPTION_LINE_RE.match(line) if line is not None else None
    if match is None:
        return ()
    name = match.group(1).rsplit(".", 1)[-1]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return tuple(c.__name__ for c in cls.__mro__)
    return (name,)


def _child_killed(number: int, tail: list[str], last: str) -> Outcome:
    """The child itself died of a signal: infrastructure, whatever its log says (it did not finish)."""
    name = _signal_name(number)
    message = f"killed by {name}"
    host = judge(Evidence(tail, status=1))
    if host.error_class == ErrorClass.INFRA:
        message += f" ({host.code}: {host.message})"
    elif number == signal.SIGKILL and host.error_class == ErrorClass.UNKNOWN:
        message += f" (possibly OOM-killed: nothing in the log explains it; {memory_words()})"
    elif last:
        message += f"; last output: {last}"
    return Outcome(ErrorClass.INFRA, name if name.startswith("SIG") else f"SIGNAL_{number}", one_line(message))
