"""Classifying a finished compile child: deterministic compile error (final) or infrastructure (retry).

Owns the rules, and the log patterns they rest on (the Neuron backend reuses :func:`find_compiler_error`
so the child and the runner read compiler output the same way). Pure functions; imports nothing heavy.

Rules, first match wins:

1. ``cancelled`` -> ``cancelled``; ``timed_out`` -> ``timeout`` (retried, like infra).
2. exit 0 with an ``ok`` result -> success (``error_class`` None); exit 0 without one -> infra.
3. exit 3 with a ``compile_error`` result -> compile, with the result's code and message.
4. killed by a signal (negative return code) -> infra, whatever the log says: the compile did not finish.
   SIGKILL with nothing in the log explaining it is reported as "possibly OOM-killed".
5. an ``infra_error`` result -> infra with its code.
6. infrastructure hints in the log tail -> infra: "error while loading shared libraries", missing
   modules, host out of memory, disk full. These win over compiler codes: a broken host must not fail a
   key for good.
7. exit 70 -> infra: neuronx-cc's internal-error exit, seen intermittently at high tp degrees. It wins
   over a code in the log because wrongly retrying costs one more attempt, wrongly failing costs the key.
8. a neuronx-cc ``NCC_E...`` code (including ``NCC_EOOM...``: the model exceeds the device's HBM, which
   no retry changes), or "Unsupported operator"/"unsupported op", in the log tail -> compile.
   Exit 3 whose result.json went missing but whose log has the child's own "compile error" line -> compile.
9. anything else -> infra (unknown failures are retried).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from compilesvc.states import RETRIED, ErrorClass

#: Longest message an Outcome carries.
MAX_MESSAGE = 500

#: neuronx-cc error codes: NCC_E + a 2-6 letter component + digits (NCC_EOOM001, NCC_EVRF007, NCC_EARG001).
NCC_ERROR_RE = re.compile(r"\b(NCC_E[A-Z]{2,6}\d{1,4})\b")
UNSUPPORTED_OP_RE = re.compile(r"unsupported\s+(operator|op)\b", re.IGNORECASE)
#: The child's own log line for a compile error (workers.compile_child).
CHILD_COMPILE_ERROR_RE = re.compile(r"\[compile-child\] compile error (\S+): (.*)")

_INFRA_HINTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("SHARED_LIBRARY", re.compile(r"error while loading shared libraries|cannot open shared object file")),
    # A traceback's last line, not a warning that merely mentions a module ("No module named 'numpy'"
    # is printed by every torch import on hosts without numpy).
    ("MISSING_MODULE", re.compile(r"^\s*(?:[\w.]+\.)?(?:ModuleNotFoundError|ImportError)\b")),
    ("HOST_OOM", re.compile(r"^\s*MemoryError\b|Cannot allocate memory|can't allocate memory|std::bad_alloc|"
                            r"Out of memory: Kill|oom-kill", re.IGNORECASE)),
    ("DISK_FULL", re.compile(r"No space left on device")),
)

#: neuronx-cc exits 70 (EX_SOFTWARE) on internal errors that come and go, notably at high tp degrees.
INTERMITTENT_EXIT = 70


@dataclass(frozen=True)
class Outcome:
    """How a compile attempt ended. ``error_class`` None means success."""

    error_class: ErrorClass | None
    code: str | None
    message: str

    @property
    def ok(self) -> bool:
        return self.error_class is None

    @property
    def retryable(self) -> bool:
        """Infrastructure failures and timeouts are retried; compile errors and cancellations are not."""
        return self.error_class in RETRIED


def _one_line(text: str) -> str:
    squeezed = " ".join(text.split())
    return squeezed if len(squeezed) <= MAX_MESSAGE else squeezed[: MAX_MESSAGE - 1] + "…"


def find_compiler_error(lines: Iterable[str]) -> tuple[str, str] | None:
    """``(code, line)`` for the first neuronx-cc error code or unsupported-operator message, else None.

    The first is taken: later errors are usually consequences or summaries of it.
    """
    unsupported: tuple[str, str] | None = None
    for line in lines:
        match = NCC_ERROR_RE.search(line)
        if match:
            # From the code on: the timestamp/pid/logger prefix is noise in a one-line message.
            start = match.start() - 1 if match.start() > 0 and line[match.start() - 1] == "[" else match.start()
            return match.group(1), _one_line(line[start:])
        if unsupported is None:
            op = UNSUPPORTED_OP_RE.search(line)
            if op:
                unsupported = ("UNSUPPORTED_OPERATOR", _one_line(line[op.start():]))
    return unsupported


def find_infra_hint(lines: Iterable[str]) -> tuple[str, str] | None:
    """``(code, line)`` for the first line showing host trouble, else None (compiler-coded lines skipped)."""
    for line in lines:
        if NCC_ERROR_RE.search(line):  # "NCC_EOOM..." is the device's memory, not the host's
            continue
        for code, pattern in _INFRA_HINTS:
            if pattern.search(line):
                return code, _one_line(line)
    return None


def _last_line(lines: Sequence[str]) -> str:
    for line in reversed(lines):
        if line.strip():
            return _one_line(line)
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _infra(code: str, message: str) -> Outcome:
    return Outcome("infra", code, _one_line(message))


def classify(returncode: int, result: dict[str, Any] | None, log_tail: list[str], timed_out: bool,
             cancelled: bool) -> Outcome:
    """Classify one compile child run (see the module docstring for the rules).

    ``returncode`` is the child's (negative: killed by that signal), ``result`` its parsed
    ``result.json`` or None, ``log_tail`` the last lines of its combined stdout/stderr, ``timed_out``
    and ``cancelled`` whether the runner killed it for those reasons.
    """
    tail = [line.rstrip("\n") for line in log_tail]
    status = result.get("status") if isinstance(result, dict) else None
    last = _last_line(tail)

    if cancelled:
        return Outcome("cancelled", "CANCELLED", "cancelled")
    if timed_out:
        return Outcome("timeout", "TIMEOUT", _one_line("time limit reached" + (f"; last output: {last}" if last
                                                                                else "; no output")))
    if returncode == 0:
        if status == "ok":
            return Outcome(None, None, "ok")
        return _infra("PROTOCOL", f"exit 0 but result.json is {'missing' if result is None else repr(status)}")
    if returncode == 3 and status == "compile_error" and isinstance(result, dict):
        return Outcome("compile", str(result.get("code") or "COMPILE_ERROR"),
                       _one_line(str(result.get("message") or "compile error")))

    hint = find_infra_hint(tail)
    compiler_error = find_compiler_error(tail)
    if returncode < 0:
        name = _signal_name(-returncode)
        message = f"killed by {name}"
        if hint:
            message += f" ({hint[0]}: {hint[1]})"
        elif -returncode == signal.SIGKILL and compiler_error is None:
            message += " (possibly OOM-killed: nothing in the log explains it)"
        elif last:
            message += f"; last output: {last}"
        return _infra(name if name.startswith("SIG") else f"SIGNAL_{-returncode}", message)
    if status == "infra_error" and isinstance(result, dict):
        return _infra(str(result.get("code") or "INFRA"), str(result.get("message") or f"exit {returncode}"))
    if hint:
        return _infra(hint[0], hint[1])
    if returncode == INTERMITTENT_EXIT:
        return _infra("EXIT_70", f"exit 70 (neuronx-cc internal error, intermittent at high tp; retried)"
                                 f"{'; last output: ' + last if last else ''}")
    if compiler_error:
        return Outcome("compile", compiler_error[0], compiler_error[1])
    if returncode == 3:
        for line in reversed(tail):
            match = CHILD_COMPILE_ERROR_RE.search(line)
            if match:
                return Outcome("compile", match.group(1), _one_line(match.group(2)))
    message = f"exit {returncode}"
    if 128 < returncode < 128 + 65:  # a shell or container reporting a signal as 128+N
        message += f" (perhaps {_signal_name(returncode - 128)})"
    return _infra(f"EXIT_{returncode}", message + (f"; last output: {last}" if last else "; no output"))
