"""The compile child's own output, seen while it passes: :class:`OutputTee` copies fds 1 and 2 (Python, C code and
child processes alike) through to where they went, keeping the last lines for the failure classifier
(:mod:`workers.backends.neuron`: neuronx-cc's error codes are only in its output, not in the exception)."""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections import deque

#: How many recent output lines are kept for finding error codes.
TAIL_LINES = 400
#: How long the pipes must stay empty, once the compile returned, to count as drained; and how long the
#: drain may take in all (a process outliving the compile may keep writing).
IDLE_POLL_SECONDS = 0.05
DRAIN_SECONDS = 5.0


class OutputTee:
    """Copies everything written to fds 1 and 2 (by Python, C code or child processes) through to them,
    keeping the last lines.

    torch_neuronx runs neuronx-cc as a subprocess that inherits our stdout/stderr; its error codes are
    only in that output (and its log file), not in the exception. Pipes replace fds 1 and 2 while active;
    a thread per pipe writes the bytes on to the original fd at once, so the runner still streams them.
    """

    def __init__(self, keep: int = TAIL_LINES):
        self._lines: deque[str] = deque(maxlen=keep)
        self._lock = threading.Lock()  # a pump outliving __exit__ (see there) may still append
        self._saved: list[tuple[int, int]] = []
        self._drained: list[threading.Event] = []
        self._closing = threading.Event()

    def _pump(self, read_fd: int, out_fd: int, drained: threading.Event) -> None:
        pending = b""
        while True:
            closing = self._closing.is_set()  # read before the wait: an idle wait counts only if wholly after
            if not select.select([read_fd], [], [], IDLE_POLL_SECONDS)[0]:
                if closing:
                    # Our fds are restored and the compile returned: an empty pipe means its output is all
                    # through, even when EOF never comes because a process that outlives the compile holds
                    # the write end (multiprocessing's resource tracker, started by torch's spawn, inherits
                    # fds 1 and 2 and lives as long as this process). A last line without its newline counts.
                    if pending:
                        with self._lock:
                            self._lines.append(pending.decode(errors="replace"))
                        pending = b""
                    drained.set()
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                written = os.write(out_fd, view)
                view = view[written:]
            pending += chunk
            *complete, pending = pending.split(b"\n")
            with self._lock:
                self._lines.extend(line.decode(errors="replace") for line in complete)
        if pending:
            with self._lock:
                self._lines.append(pending.decode(errors="replace"))
        os.close(read_fd)
        os.close(out_fd)  # at EOF only: a pump still forwarding a lingering writer keeps its fd
        drained.set()

    @property
    def lines(self) -> list[str]:
        """The last lines seen so far (stdout and stderr interleaved)."""
        with self._lock:
            return list(self._lines)

    def __enter__(self) -> OutputTee:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            saved = os.dup(fd)
            read_fd, write_fd = os.pipe()
            os.dup2(write_fd, fd)
            os.close(write_fd)
            drained = threading.Event()
            thread = threading.Thread(target=self._pump, args=(read_fd, saved, drained), daemon=True,
                                      name=f"tee-fd{fd}")
            thread.start()
            self._saved.append((fd, saved))
            self._drained.append(drained)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved:
            os.dup2(saved, fd)  # drops our write end of the pipe; the pump sees EOF, or an idle pipe
        self._closing.set()
        # A compiler daemon still writing into the pipe must not hang the child: 5 s at most, for both.
        deadline = time.monotonic() + DRAIN_SECONDS
        for drained in self._drained:
            drained.wait(max(0.0, deadline - time.monotonic()))
