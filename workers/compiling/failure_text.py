"""What the tools print when a compile fails: their error codes and messages as patterns, and reading a log tail.

Owns the patterns that name a failure's evidence in a log, per tool (neuronx-cc's codes, the compile child's own
line, Python's argparse and OSError wording), and the readers that take a log apart (its last line, the
exception the last traceback ends in, a signal's name). The classification table
(:mod:`workers.compiling.failure_table`) and its judge (:mod:`workers.compiling.classify`) read logs through
them. Pure functions; imports nothing heavy.
"""

from __future__ import annotations

import builtins
import re
import signal
from collections.abc import Sequence

from workers.compiling.contract import one_line

# -- neuronx-cc ---------------------------------------------------------------------------------------------

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

# -- the compile child ----------------------------------------------------------------------------------------

#: The child's own log line for a compile error (workers.backends.compile_child).
CHILD_COMPILE_ERROR_RE = re.compile(r"\[compile-child\] compile error (\S+): (.*)")

# -- Python: argparse, OSError, tracebacks --------------------------------------------------------------------

#: An argument parser refusing the command line: argparse's wording, which a Python CLI such as neuronx-cc's
#: driver prints as ``neuronx-cc compile: error: …`` (exit 2). Group ``flag`` names the rejected flag.
REJECTED_FLAG_RE = re.compile(
    r"\berror: (?:unrecognized arguments: (?P<flags>.+)"
    r"|argument (?P<flag>[^\s:]+(?:/[^\s:]+)*): (?:invalid|expected|ignored explicit|not allowed)"
    r"|ambiguous option: (?P<ambiguous>[^\s=]+))")
#: An OSError's text where an exception is reported: a traceback's "PermissionError: [Errno 13] …" or the
#: compiler driver's "Unhandled exception with message: [Errno 5] …".
OS_ERROR_RE = re.compile(r"(?:\b[A-Z]\w*Error|Unhandled exception with message):\s*\[Errno \d+\]")
#: A traceback's last line: an unindented exception name, then ": message" or nothing.
_EXCEPTION_LINE_RE = re.compile(r"^([A-Za-z_][\w.]*)(?::|\s*$)")


def rejected_flag(match: re.Match[str]) -> str:
    """The flag(s) a :data:`REJECTED_FLAG_RE` match names."""
    flags = match.group("flags") or match.group("flag") or match.group("ambiguous") or ""
    return flags.strip()


def last_line(lines: Sequence[str]) -> str:
    """The last non-blank line, on one line ("" when there is none)."""
    for line in reversed(lines):
        if line.strip():
            return one_line(line)
    return ""


def raised_line(lines: Sequence[str]) -> str | None:
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


def traceback_exception(lines: Sequence[str]) -> tuple[str, ...]:
    """The class hierarchy (for builtins; else just the name) of the exception the last traceback ends in."""
    line = raised_line(lines)
    match = _EXCEPTION_LINE_RE.match(line) if line is not None else None
    if match is None:
        return ()
    name = match.group(1).rsplit(".", 1)[-1]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return tuple(c.__name__ for c in cls.__mro__)
    return (name,)


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal N`` for a number that names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
