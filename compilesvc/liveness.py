"""A process's liveness, as a file another process reads: the signal a liveness probe checks.

A long-running process (the worker: it consumes; the relay: its loop comes round) proves for itself that it still
does its job, and writes what it found to a small JSON file (:class:`LivenessFile`): its pid, its state, when it
wrote, and until when that statement holds (``fresh_until``). A probe (``compilesvc worker --check-alive``,
compose's healthcheck, the chart's livenessProbe) reads it with :func:`check`, which needs no settings, no ledger
and no broker: the file says everything. The process is not alive when the file is missing or unreadable, when
``fresh_until`` has passed (the process stopped writing: frozen, or its checking thread died), when the pid it
names is gone, or when its state is ``dead``.

Probes run ``python -m compilesvc.liveness worker`` (stdlib only: a probe every few seconds must not load
SQLAlchemy and Celery); ``compilesvc worker --check-alive`` is the same check for a person. Both read
``COMPILESVC_LIVENESS_FILE``, else :func:`default_path`: one file per process name and host, so workers
sharing a volume (compose's ``--scale``) do not write each other's.

A process that found itself broken but still has work to finish (a worker that stopped consuming, with
compiles running) writes ``stopping``: still alive to the probe, so the orchestrator does not kill the
compiles, and it exits by itself once they end (``fresh_until`` bounds that too).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: What a process found the last time it checked itself.
STATES = ("starting", "alive", "busy", "stopping", "dead")


def default_path(process: str) -> Path:
    """Where ``process`` (``worker``) on this host writes when ``COMPILESVC_LIVENESS_FILE`` is unset: the temp
    directory (the image's TMPDIR), named by the host, which is the container's in compose and the pod's."""
    return Path(tempfile.gettempdir()) / f"compilesvc-{process}.{socket.gethostname()}.alive"


def configured_path(process: str) -> Path:
    """The file of ``process``: ``COMPILESVC_LIVENESS_FILE`` (the setting ``liveness_file``), else the default."""
    return Path(os.environ.get("COMPILESVC_LIVENESS_FILE") or default_path(process))


@dataclass(frozen=True)
class Status:
    """One reading of a liveness file."""

    alive: bool
    detail: str


class LivenessFile:
    """The writer's side: one file per process, rewritten atomically at each check."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, state: str, fresh_for: float, detail: str = "") -> None:
        if state not in STATES:
            raise ValueError(f"unknown liveness state {state!r}")
        now = time.time()
        body = {"pid": os.getpid(), "state": state, "at": now, "fresh_until": now + fresh_for, "detail": detail}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not synced: a probe reads it within seconds, and after a crash a stale file is what it should see.
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temp.write_bytes(json.dumps(body).encode())
        os.replace(temp, self.path)  # a probe never reads half a file


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def check(path: Path, now: float | None = None) -> Status:
    """Whether the process that writes ``path`` is alive, and why not (see the module docstring)."""
    now = time.time() if now is None else now
    try:
        body = json.loads(path.read_bytes())
        pid, state, fresh_until = int(body["pid"]), str(body["state"]), float(body["fresh_until"])
        detail = str(body.get("detail") or "")
    except FileNotFoundError:
        return Status(False, f"{path}: no liveness file (the process has not started, or is another's)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Status(False, f"{path}: unreadable liveness file ({type(exc).__name__}: {exc})")
    if state == "dead":
        return Status(False, f"{path}: {detail or 'the process says it is dead'}")
    if now > fresh_until:
        return Status(False, f"{path}: not rewritten since {now - fresh_until:.0f} s past its deadline "
                             f"(last state {state!r}): the process stopped checking itself")
    if not _pid_running(pid):
        return Status(False, f"{path}: pid {pid} is not running")
    return Status(True, f"{state}{': ' + detail if detail else ''}")


def main(argv: list[str]) -> int:
    """``python -m compilesvc.liveness PROCESS``: exit 0 alive, 1 not, 2 usage; one line saying why."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m compilesvc.liveness worker|relay", file=sys.stderr)
        return 2
    status = check(configured_path(argv[0]))
    print(("alive: " if status.alive else "not alive: ") + status.detail,
          file=sys.stdout if status.alive else sys.stderr)
    return 0 if status.alive else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
