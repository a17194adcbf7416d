"""A sandboxed compile that ran into one of its limits: the model's doing, told apart from the host's failing.

Outside the sandbox, an allocation failure or a failed fork says the *host* is short (another compile took
the memory): infrastructure, retried (:mod:`workers.compiling.classify`). Inside it, the same evidence most often
means the compile hit the limit the operator set for every compile (:class:`workers.isolation.sandbox.Limits`), and
compiling it again under the same limits can only do the same. So a sandboxed run's infrastructure or
unexplained failure whose evidence names a limit becomes a compile error with a ``SANDBOX_*_LIMIT`` code
and a message naming the setting: final for the key until an explicit retry (after an operator raised the
limit, or the model changed), and never retried three times at hours each.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from compilesvc.states import ErrorClass
from workers.compiling.classify import Outcome
from workers.compiling.contract import one_line
from workers.isolation.sandbox import Limits

#: Evidence of each limit in the child's output (Python's errno texts, torch's and the C++ runtime's), with the
#: setting that raises it and the :class:`Limits` field holding its value.
_EVIDENCE: tuple[tuple[str, re.Pattern[str], str, str, str], ...] = (
    ("SANDBOX_FILE_SIZE_LIMIT", re.compile(r"\[Errno 27\]|File too large"), "COMPILESVC_SANDBOX_MAX_FILE_MB",
     "file_bytes", "a file larger than the sandbox allows"),
    ("SANDBOX_OPEN_FILES_LIMIT", re.compile(r"\[Errno 24\]|Too many open files"), "COMPILESVC_SANDBOX_MAX_OPEN_FILES",
     "open_files", "more open files than the sandbox allows"),
    ("SANDBOX_PROCESS_LIMIT", re.compile(r"BlockingIOError: \[Errno 11\]|fork: (?:retry: )?Resource temporarily"
                                         r"|[Cc]annot fork|can't start new thread"),
     "COMPILESVC_SANDBOX_MAX_PROCESSES", "processes", "more processes than the sandbox allows"),
    ("SANDBOX_MEMORY_LIMIT", re.compile(r"\bMemoryError\b|can't allocate memory|[Cc]annot allocate memory"
                                        r"|std::bad_alloc|\[Errno 12\]"),
     "COMPILESVC_SANDBOX_MEMORY_MB", "memory_bytes", "more memory than the sandbox allows"),
)

#: Limits whose errno only the sandbox's own rlimits produce inside it (EFBIG: RLIMIT_FSIZE, EMFILE:
#: RLIMIT_NOFILE): a model that hits one gets a compile error naming only the errno (torch's
#: ``from_file`` says "unable to resize file <…>: File too large (27)"), which is the limit too.
_RLIMIT_ONLY = frozenset({"SANDBOX_FILE_SIZE_LIMIT", "SANDBOX_OPEN_FILES_LIMIT"})


def limit_outcome(outcome: Outcome, stopped_for: tuple[str, str] | None, returncode: int, tail: Sequence[str],
                  limits: Limits) -> Outcome:
    """``outcome`` of a sandboxed run, or the limit it ran into (see the module docstring).

    ``stopped_for``: the (code, why) of a limit the runner watches itself (disk, output) and stopped the
    child for, if it did.
    """
    if stopped_for is not None:
        code, why = stopped_for
        return Outcome(ErrorClass.COMPILE, code, one_line(f"the compile {why}"))
    if outcome.error_class not in (ErrorClass.INFRA, ErrorClass.UNKNOWN):
        return _named_by_compile_error(outcome, limits)
    text = "\n".join([*tail, outcome.message or ""])
    for code, pattern, setting, field, what in _EVIDENCE:
        value = getattr(limits, field)
        if value is None or (field == "memory_bytes" and not limits.memory_set):
            continue
        if pattern.search(text) or (code == "SANDBOX_FILE_SIZE_LIMIT" and returncode == -signal.SIGXFSZ):
            return _hit(code, what, value, setting)
    return outcome


def _named_by_compile_error(outcome: Outcome, limits: Limits) -> Outcome:
    """A compile error whose own message (never the model's log, which may say anything) names the errno of
    one of :data:`_RLIMIT_ONLY`: that limit."""
    if outcome.error_class != ErrorClass.COMPILE:
        return outcome
    for code, pattern, setting, field, what in _EVIDENCE:
        if code in _RLIMIT_ONLY and pattern.search(outcome.message or ""):
            return _hit(code, what, getattr(limits, field), setting)
    return outcome


def _hit(code: str, what: str, value: int, setting: str) -> Outcome:
    return Outcome(ErrorClass.COMPILE, code, f"the compile needed {what} (limit {value}, {setting}); raise the "
                                             f"setting on the workers and retry the build if the model really "
                                             f"needs it")
