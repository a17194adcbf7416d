"""The compile child as a process: its own session (so a timeout or cancel kills the compiler's whole tree),
tied to the worker's life (SIGKILL when the worker dies), its output pumped to a sink while it runs.

Used by the runner for every attempt and by ``compilesvc doctor``, so both run compilers the same way: inside
the compile sandbox (:mod:`workers.isolation.sandbox`) unless the operator turned it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from workers.isolation.sandbox import Sandbox

_PR_SET_PDEATHSIG = 1
try:
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
    _prctl = None


#: How often the runner looks at what a sandboxed child wrote (its disk limit).
DISK_CHECK_SECONDS = 1.0


def _die_with_parent(parent_pid: int, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """preexec_fn: the child gets SIGKILL when the worker dies (even by SIGKILL), so a crashed worker
    leaves no compiler running unseen. Linux ties this to the *thread* that started the child: the
    worker's pool threads live as long as the worker does. Resolved before the fork, so the child only
    makes one C call before exec."""
    prctl = _prctl

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the worker died between fork and prctl
            os._exit(1)
        if then is not None:
            then()

    return preexec



class StopSignal(Protocol):
    """What tells a wait to stop the compile: a :class:`threading.Event`, or several (``drain.Either``)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

class OutputSink(Protocol):
    """Where the child's output goes (:class:`workers.compiling.logstream.LogStream` for a worker, a file for the
    doctor): ``pump`` reads the stream to its end, on a thread of its own."""

    def pump(self, stream: IO[bytes]) -> None: ...


class CompilerProcess:
    """The compile child in its own session (= process group), with output pumped into ``logs``."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], logs: OutputSink,
                 sandbox: Sandbox | None = None):
        self.sandbox = sandbox
        self._logs = logs
        #: The limit the runner stopped the child for, as (code, why) (None: it did not).
        self.limit: tuple[str, str] | None = None
        #: Why the attempt failed for want of infrastructure rather than by the compile (never, here: a
        #: child of this process cannot get lost; workers.isolation.spool_process's can).
        self.lost: str | None = None
        limits: Callable[[], None] | None = None
        if sandbox is not None:
            sandbox.hand_over()
            argv, env = sandbox.argv(argv, cwd), sandbox.environment(cwd)
            limits = sandbox.preexec()
            cwd = sandbox.process_cwd(cwd)
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, preexec_fn=_die_with_parent(os.getpid(), limits),
        )
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group
        assert self.proc.stdout is not None
        self._stdout = self.proc.stdout
        self._reader = threading.Thread(target=logs.pump, args=(self._stdout,), name=f"pump-{self.pgid}",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def returncode(self) -> int:
        """The child's exit status; negative: killed by that signal. bubblewrap reports a child killed by
        signal N as 128 + N; the compile child itself never exits above 6 (workers.backends.compile_child)."""
        code = self.proc.returncode
        if self.sandbox is not None and 128 < code < 128 + signal.NSIG:
            return -(code - 128)
        return code

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is empty already
            os.killpg(self.pgid, sig)

    def stop_group(self, grace: float) -> None:
        """SIGTERM the whole group, SIGKILL it if the leader is still there after ``grace`` seconds."""
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
        self.proc.wait()

    def _over_limit(self) -> tuple[str, str] | None:
        """A limit the runner watches itself, as (code, why): bytes on disk (the sandbox's), bytes printed (the
        sink's, when it counts them)."""
        assert self.sandbox is not None
        if why := self.sandbox.over_disk_limit():
            return "SANDBOX_DISK_LIMIT", why
        printed = getattr(self._logs, "over_limit", None)
        if printed is not None and (why := printed()):
            return "SANDBOX_OUTPUT_LIMIT", why
        return None

    def wait(self, timeout: float, stop: StopSignal, grace: float) -> tuple[int, bool]:
        """Wait for the child; kill the group on ``stop`` or after ``timeout`` seconds.

        Returns ``(returncode, timed_out)``.
        """
        deadline = time.monotonic() + timeout
        next_disk_check = time.monotonic() + DISK_CHECK_SECONDS
        timed_out = False
        while True:
            try:
                self.proc.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop.is_set():
                self.stop_group(grace)
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                self.stop_group(grace)
                break
            if self.sandbox is not None and now >= next_disk_check:
                next_disk_check = now + DISK_CHECK_SECONDS
                self.limit = self._over_limit()
                if self.limit is not None:
                    self.stop_group(0)
                    break
        # Compiler processes the child started may outlive it in its group: the attempt is over for them.
        self.signal_group(signal.SIGKILL)
        self._reader.join(10)
        if self._reader.is_alive():  # something outside the group holds the pipe open: stop reading
            self._stdout.close()
            self._reader.join(5)
        return self.returncode, timed_out
