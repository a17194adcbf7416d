"""Classifying a failed compile by evidence: what the compiler printed and how it ended decide its class.

Owns applying the classification table (:data:`workers.compiling.failure_table.TABLE`, the rows and their
sources; the patterns they read are :mod:`workers.compiling.failure_text`) and the words of its verdicts. The
Neuron backend applies it in the compile child (:func:`judge`, for a failed ``neuronx-cc`` run or
``torch_neuronx.trace`` call); the runner applies it to the log of a child that died without a result, after its
own rules (:func:`classify`). Pure functions; imports nothing heavy.

Runner rules before the table (:func:`classify`): cancelled -> ``cancelled``; timed out -> ``timeout``;
exit 0 with an ``ok`` result -> success, without one -> infra ``PROTOCOL``; child killed by a signal ->
infra (the compile did not finish, whatever its log says); a result.json from the child -> its class (the
child already applied the table, or raised a worker problem itself: wrong host or SDK, package missing).
"""

from __future__ import annotations

import re
import resource
import signal
from dataclasses import dataclass
from typing import Any

from compilesvc.hostinfo import host_memory_bytes
from compilesvc.states import RETRIED, ErrorClass
from workers.compiling.contract import one_line
from workers.compiling.failure_table import F137_ROW, TABLE, Evidence, Row
from workers.compiling.failure_text import (
    CHILD_COMPILE_ERROR_RE,
    NCC_ERROR_RE,
    last_line,
    raised_line,
    rejected_flag,
    signal_name,
    traceback_exception,
)

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
class Verdict:
    """What :func:`judge` decided: the class, the code, a one-line message and the row that decided."""

    error_class: ErrorClass
    code: str
    message: str
    row: str  # the name of the row of TABLE that decided


def _from_code_on(line: str, match: re.Match[str]) -> str:
    """The line from the code on: the timestamp/pid/logger prefix is noise in a one-line message."""
    start = match.start()
    if start > 0 and line[start - 1] == "[":
        start -= 1
    return one_line(line[start:])


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
        return last_line(evidence.lines), None
    if row.pattern is None and not row.exceptions:
        return last_line(evidence.lines), None
    return None


def _message(row: Row, evidence: Evidence, line: str, match: re.Match[str] | None) -> str:
    status = evidence.status
    last = last_line(evidence.lines)
    if row.name == F137_ROW:
        return one_line(f"{evidence.who} ran out of host memory: {line.strip()} ({memory_words()})")
    if row.name == "killed-by-signal" and status is not None:
        name = signal_name(-status)
        why = f" (possibly OOM-killed: {memory_words()})" if -status == signal.SIGKILL else ""
        return f"{evidence.who} was killed by {name}{why}" + (f"; last output: {last}" if last else "")
    if row.name == "rejected-flag" and match is not None:
        return one_line(f"the compiler rejected {rejected_flag(match)}: {line.strip()}")
    if row.name == "unknown":
        ended = f"failed with {status}" if status is not None else "failed"
        # What was raised says more than a multi-line message's last line; quote both when they differ.
        raised = raised_line(evidence.lines)
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
    last = last_line(tail)

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
        message = one_line(f"{message} (exit {returncode}: perhaps {signal_name(returncode - 128)})")
    return Outcome(verdict.error_class, verdict.code, message)


def _child_killed(number: int, tail: list[str], last: str) -> Outcome:
    """The child itself died of a signal: infrastructure, whatever its log says (it did not finish)."""
    name = signal_name(number)
    message = f"killed by {name}"
    host = judge(Evidence(tail, status=1))
    if host.error_class == ErrorClass.INFRA:
        message += f" ({host.code}: {host.message})"
    elif number == signal.SIGKILL and host.error_class == ErrorClass.UNKNOWN:
        message += f" (possibly OOM-killed: nothing in the log explains it; {memory_words()})"
    elif last:
        message += f"; last output: {last}"
    return Outcome(ErrorClass.INFRA, name if name.startswith("SIG") else f"SIGNAL_{number}", one_line(message))
