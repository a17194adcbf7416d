"""The compile runner: the process of a pod's secret-less compile container that runs the compiles its
worker hands over through the spool (:mod:`workers.isolation.spool`; the worker's side is
:mod:`workers.isolation.spool_process`).

Usage: ``python -m workers.isolation.compile_runner --spool DIR [--once]`` (or ``compilesvc compile-runner``).

Where bubblewrap cannot be had (a Kubernetes pod without user namespaces), isolation comes from the pod
instead: this runner's container holds no secrets and no service settings, mounts only the spool (the
models in it read-only) and nothing else of the worker's, and a NetworkPolicy bounds the pod's traffic
(docs/deploy.md, "Compile isolation"). For each attempt it runs ``workers.backends.compile_child`` exactly as
:class:`workers.isolation.compiler_process.CompilerProcess` does for the worker (it *is* that class): its own session,
death with the runner, the sandbox's rlimits (processes, open files, file size, address space), its disk
and output limits, and the time limit; plus a network namespace of its own where unprivileged user
namespaces exist (``unshare``), so it cannot use the pod's network at all.

It refuses to start (exit 78, EX_CONFIG) when its environment holds service settings or credentials, or
when an EKS web-identity or Pod Identity token file is mounted into its container: a runner that sees them
would hand them to the compile, which is what the split is for. After each attempt
no process of it is left: as PID 1 of its container it kills every other process of the PID namespace,
otherwise the child's process group (a compile that left its group is then the container's to reap:
run it as PID 1, as the manifest does). ``--once`` exits after one attempt (a Job per attempt).

The egress proof (:mod:`workers.isolation.egress`): at start and before every compile the runner dials the
configured canaries (``COMPILESVC_EGRESS_CANARIES``) from the compile's network (its own, or the namespace
``unshare`` makes) and, if one answers, refuses (exit 78, naming it) unless ``COMPILESVC_EGRESS_ACKNOWLEDGED=1``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, NoReturn

import click

from workers.isolation import egress
from workers.isolation.child_env import allowed, child_environment
from workers.isolation.compiler_process import CompilerProcess
from workers.isolation.sandbox import Limits, Mounts, Policy, Sandbox, device_nodes, output_limit_why
from workers.isolation.spool import (
    ATTEMPTS,
    CANCEL,
    CLAIMED,
    CONTROL,
    LOG,
    REQUEST,
    RUN,
    RUNNER,
    STAGING_PREFIX,
    STATUS,
    beat,
    read_document,
    write_document,
)

log = logging.getLogger("compilesvc.compile_runner")

EX_CONFIG = 78
HEARTBEAT_SECONDS = 1.0
POLL_SECONDS = 0.2
#: Seconds past the worker's own time limit before the runner stops a child by itself (the worker asks
#: first; this is for a worker that died without asking).
BACKSTOP_SECONDS = 30.0
KILL_GRACE_SECONDS = 5.0
#: Settings that reach the service or carry a credential (compilesvc/config/settings.py, the AWS chain, libpq). The
#: image's own harmless settings (COMPILESVC_DATA_DIR, COMPILESVC_SANDBOX_READ_PATHS …) may stay: the runner
#: reads none of them and the compile child gets only workers.isolation.child_env's allow-list.
SERVICE_SETTINGS = frozenset({
    "COMPILESVC_DATABASE_URL", "COMPILESVC_BROKER_URL", "COMPILESVC_STORE_URL", "COMPILESVC_S3_ENDPOINT_URL",
    "COMPILESVC_SECRET_KEY", "COMPILESVC_BOOTSTRAP_TOKEN", "COMPILESVC_SIGNING_KEY_FILE",
    "COMPILESVC_WEBHOOK_SECRET", "DATABASE_URL", "BROKER_URL", "REDIS_URL", "PGPASSWORD", "PGPASSFILE",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
})
#: The runner's own settings, allowed in its container whatever the rules above say: the egress proof's
#: canaries and its acknowledgement (workers.isolation.egress; the chart renders both).
RUNNER_SETTINGS = frozenset({"COMPILESVC_EGRESS_CANARIES", "COMPILESVC_EGRESS_ACKNOWLEDGED"})
_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE_KEY")
#: Where the EKS pod-identity webhook mounts a service-account token that trades for AWS credentials
#: (aws/amazon-eks-pod-identity-webhook: IRSA, handler.go NewModifier's MountPath + "token"; Pod Identity,
#: main.go's container-credentials-token-mount-path + -token-path defaults). The webhook mounts it into every
#: container the pod annotation eks.amazonaws.com/skip-containers does not name: a file here is a credential
#: the compile could read even with the variables gone.
TOKEN_FILES = (
    Path("/var/run/secrets/eks.amazonaws.com/serviceaccount/token"),
    Path("/var/run/secrets/pods.eks.amazonaws.com/serviceaccount/eks-pod-identity-token"),
)
#: What to do about either refusal: the chart names the compile container in that annotation.
CREDENTIALS_FIX = ("name this container in the pod annotation eks.amazonaws.com/skip-containers (the Helm chart "
                   "renders it for its compile container; a pod of your own must carry it too)")


def refused_environment(environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` a compile container must not hold: the service's connection settings and
    credentials (:data:`SERVICE_SETTINGS`), and anything named like a secret that the compile child would
    not get anyway."""
    return sorted(name for name in environ if name.upper() not in RUNNER_SETTINGS and (
                  name.upper() in SERVICE_SETTINGS
                  or (any(word in name.upper() for word in _SECRET_WORDS) and not allowed(name))))


def mounted_credentials(paths: tuple[Path, ...] | None = None) -> list[str]:
    """The token files of :data:`TOKEN_FILES` this container can see (mounted by the pod-identity webhook)."""
    return [str(path) for path in (TOKEN_FILES if paths is None else paths) if path.exists()]


def own_network_namespace() -> list[str]:
    """The command prefix that gives a child a network namespace of its own (only a loopback), or [] where
    this container may not make one (no unprivileged user namespaces): the child then shares the pod's."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    prefix = [unshare, "--user", "--map-current-user", "--net", "--"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else []


class RunnerSandbox(Sandbox):
    """What the runner can give a child without bubblewrap: the sandbox's rlimits, disk limit (over the
    attempt's writable directories) and a network namespace where it can make one."""

    def __init__(self, limits: Limits, writable: list[Path], env: Mapping[str, str], tmp: Path, netns: list[str]):
        super().__init__(Policy(enabled=True, user=None, limits=limits), Mounts(writable=writable), env)
        self.tmp = tmp
        self.netns = netns

    def argv(self, command: list[str], cwd: Path) -> list[str]:
        return [*self.netns, *command]

    def process_cwd(self, cwd: Path) -> Path:
        return cwd

    def environment(self, cwd: Path) -> dict[str, str]:
        return {**self.env, "HOME": str(cwd), "TMPDIR": str(self.tmp)}


class LogFile:
    """The child's output into the attempt's log file as it comes (the worker tails it), up to a bound."""

    def __init__(self, path: Path, max_bytes: int):
        self.max_bytes = max_bytes
        self.printed = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._file = os.fdopen(fd, "wb")

    def pump(self, stream: IO[bytes]) -> None:
        read = getattr(stream, "read1", stream.read)
        with self._file:
            while chunk := read(1 << 16):
                keep = max(0, min(len(chunk), self.max_bytes - self.printed))
                self.printed += len(chunk)
                if keep:
                    self._file.write(chunk[:keep])
                    self._file.flush()

    def over_limit(self) -> str | None:
        return output_limit_why(self.max_bytes) if self.printed > self.max_bytes else None


def _leave_nothing(child: CompilerProcess) -> None:
    """No process of the attempt outlives it (see the module docstring)."""
    if os.getpid() == 1:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, 0)[0] > 0:  # reap what the kernel re-parented to us
                pass
    else:
        child.signal_group(signal.SIGKILL)


def egress_refusal(netns: list[str]) -> str | None:
    """The egress proof (:mod:`workers.isolation.egress`) from the compile's network: this process's, or the
    namespace ``netns`` makes. None: no canary reached, or the operator acknowledged it (logged loudly here,
    so at start and at every compile); else the refusal."""
    targets = egress.configured_targets(os.environ)  # resolved in the pod's network, dialled from the compile's
    try:
        reached = egress.reached_from(netns, targets)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"refusing to compile: {exc}"
    if not reached:
        return None
    if egress.acknowledged(os.environ):
        log.warning("EGRESS ACKNOWLEDGED: the compile's network reaches service endpoints; compiling anyway "
                    f"({egress.ACKNOWLEDGED_ENV}=1)", extra={"reached": reached})
        return None
    return f"refusing to compile: {egress.refusal(reached)}"


def run_attempt(directory: Path, netns: list[str]) -> bool:
    """Run the attempt in ``directory`` if no runner took it yet; True if this one did. Before it runs, the
    egress proof: a compile that could reach a canary is not run, and the runner exits 78."""
    run = directory / RUN
    try:
        os.close(os.open(run / CLAIMED, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:  # taken, or not an attempt
        return False
    refused = egress_refusal(netns)
    if refused:
        with contextlib.suppress(OSError):  # the worker reports it at once instead of waiting for a status
            write_document(run / STATUS, {"error": refused[:500]})
        _refuse(refused)
    try:
        _run_claimed(directory, netns)
    except Exception as exc:  # a malformed attempt (or one a compile planted) must not stop the runner
        log.exception("attempt not run", extra={"attempt": directory.name})
        with contextlib.suppress(OSError):
            write_document(run / STATUS, {"error": f"{type(exc).__name__}: {exc}"[:500]})
    return True


def _run_claimed(directory: Path, netns: list[str]) -> None:
    run = directory / RUN
    control = read_document(directory / CONTROL)
    if control is None:
        raise ValueError("no readable control.json")
    limits = Limits(**control["limits"])
    env = child_environment(os.environ, control.get("target"))
    if control.get("probe"):
        argv = [sys.executable, "-c", "import workers.backends.compile_child"]
    else:
        argv = [sys.executable, "-m", "workers.backends.compile_child", str(directory / REQUEST)]
    writable = [directory / "work", directory / "out", directory / "tmp"]
    sandbox = RunnerSandbox(limits, writable, env, directory / "tmp", netns)
    cancel = threading.Event()
    finished = threading.Event()

    def watch_cancel() -> None:
        while not finished.wait(POLL_SECONDS):
            # A cancel, or the attempt wiped under it (a restarted worker sweeps the spool): stop.
            if os.path.lexists(directory / CANCEL) or not os.path.isdir(directory / RUN):
                cancel.set()
                return

    watcher = threading.Thread(target=watch_cancel, name="cancel-watch", daemon=True)
    watcher.start()
    sink = LogFile(run / LOG, int(control["max_log_bytes"]))
    child = CompilerProcess(argv, cwd=directory / "work", env=env, logs=sink, sandbox=sandbox)
    log.info("compile started", extra={"attempt": directory.name, "pid": child.pid})
    try:
        returncode, timed_out = child.wait(float(control["timeout_seconds"]) + BACKSTOP_SECONDS, cancel,
                                           KILL_GRACE_SECONDS)
    finally:
        finished.set()
        _leave_nothing(child)
    # A probe also says how many Neuron devices this container has: the pod gives them to the compile
    # container, not to the worker's, which registers with this count (workers.isolation.spool_process.probe).
    seen = {"devices": len(device_nodes(os.environ))} if control.get("probe") else {}
    write_document(run / STATUS, {"returncode": returncode, "signal": -returncode if returncode < 0 else None,
                                  "timed_out": timed_out, "cancelled": cancel.is_set(),
                                  "limit": list(child.limit) if child.limit else None, **seen})
    log.info("compile finished", extra={"attempt": directory.name, "returncode": returncode})


def next_attempt(spool: Path) -> Path | None:
    """The oldest handed-over attempt nobody took yet."""
    try:
        names = sorted(os.listdir(spool / ATTEMPTS))
    except OSError:
        return None
    for name in names:
        directory = spool / ATTEMPTS / name
        if name.startswith(STAGING_PREFIX) or directory.is_symlink() or not directory.is_dir():
            continue
        if not os.path.lexists(directory / RUN / CLAIMED):
            return directory
    return None


def serve(spool: Path, once: bool) -> None:
    (spool / RUNNER).mkdir(parents=True, exist_ok=True)
    (spool / ATTEMPTS).mkdir(parents=True, exist_ok=True)
    netns = own_network_namespace()
    if not netns:
        log.warning("no network namespace for compiles (unprivileged user namespaces are not available): "
                    "a compile shares the pod's network, which its NetworkPolicy bounds")
    refused = egress_refusal(netns)
    if refused:
        _refuse(refused)
    stop = threading.Event()

    def heartbeat() -> None:
        while True:
            with contextlib.suppress(OSError):  # a compile may have replaced runner/ for a moment
                beat(spool)
            if stop.wait(HEARTBEAT_SECONDS):
                return

    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    log.info("compile runner ready", extra={"spool": str(spool), "network_namespace": bool(netns)})
    while True:
        directory = next_attempt(spool)
        if directory is not None and run_attempt(directory, netns) and once:
            break
        if directory is None:
            time.sleep(POLL_SECONDS)
    stop.set()


def _refuse(message: str) -> NoReturn:
    log.error(message)
    click.echo(f"error: {message}", err=True)
    sys.exit(EX_CONFIG)


@click.command("compile-runner")
@click.option("--spool", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The spool directory shared with the worker container.")
@click.option("--once", is_flag=True, help="Exit after one attempt (one attempt per pod or Job).")
def compile_runner(spool: Path, once: bool) -> None:
    """Run the compiles a pod-mode worker hands over (the pod's secret-less compile container)."""
    from compilesvc import jsonlog

    jsonlog.configure("INFO", service="compile-runner", static={})
    refused = refused_environment(os.environ)
    if refused:
        message = ("refusing to start: the compile container's environment holds service settings or "
                   f"credentials ({', '.join(refused)}); give them to the worker container only"
                   + (f"; AWS_* from the EKS pod-identity webhook: {CREDENTIALS_FIX}"
                      if any(name.startswith("AWS_") for name in refused) else ""))
        _refuse(message)
    tokens = mounted_credentials()
    if tokens:
        _refuse(f"refusing to start: a token that trades for AWS credentials is mounted here ({', '.join(tokens)}); "
                f"{CREDENTIALS_FIX}")
    # PID 1 of a container gets no default signal actions: stop on SIGTERM like any other process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(spool, once)


if __name__ == "__main__":
    compile_runner()
