"""``compilesvc worker``: detect what this host can compile, register, consume those queues.

Startup: capabilities (:func:`workers.host.capabilities.detect_capabilities`) decide the queues (cpu:
``compile.cpu.<torch>`` and ``compile.cpu.<torch>.<isa>``; neuron: ``compile.<target>.<sdk>`` per target);
the worker registers them in the ledger's ``workers`` table (which is what lets submits with
``require_live_worker`` accept work for them), heartbeats from a thread, and runs the Celery worker
in-process. The first worker of an SDK release new to the fleet starts the campaigns of the standing
roll-forward policies covering it (:mod:`compilesvc.lifecycle.policies`), from a thread.
Told to stop (SIGTERM), it drains (:mod:`workers.compiling.drain`): it takes no new compile, says
so in the registry, gives running compiles ``drain_seconds`` to finish and hands back those that do not, then
marks itself stopped and exits. A worker that stops consuming (its canary does not arrive), or whose
``draining_at`` another process set, stops the same way but waits for its running compiles and exits 75
for its supervisor to restart it (:mod:`workers.liveness`); ``--check-alive`` reads what that check found.

A host that claims a Neuron SDK release (``COMPILESVC_NEURON_SDK``) whose installed packages are another
release's, that the release table does not know, or whose environment holds a variable that changes compiler
output does not start: one ``error:`` line naming every problem, exit status 78
(:func:`workers.host.capabilities.detect_capabilities`, ``neuron.refused``). Exit 2: bad options or settings, or
nothing to compile. Exit 75: stopped consuming (see above).

Why a thread pool by default: a task's thread does no compiling itself; it supervises the compiler's own
process (:mod:`workers.compiling.runner`), so threads are all the concurrency it needs. Prefork would fork a parent
that already runs threads (the registry heartbeat, database and broker clients) for nothing, and with it
we saw pool processes sit idle while the main process believed it had handed them a task (the failure
described in celery/billiard#389): a compile queued for hours with no one working on it. Threads also keep
a running compile alive through a broker reconnect, where prefork would terminate it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from compilesvc import jsonlog
from compilesvc.config.settings import Settings
from compilesvc.dispatch import registry
from compilesvc.ledger.engine import transaction
from compilesvc.lifecycle import policies
from compilesvc.services import Services

log = logging.getLogger("compilesvc.worker")


def registry_heartbeat_interval(settings: Settings) -> float:
    """Often enough to stay well inside ``worker_stale_seconds`` (three beats per period)."""
    return max(0.2, min(settings.heartbeat_seconds, settings.worker_stale_seconds / 3))


class RegistryHeartbeat:
    """Keeps the worker's registry row fresh; re-registers if the row vanished or was marked stopped."""

    def __init__(self, services: Services, worker_id: str, capabilities: dict[str, Any], queues: list[str],
                 slots: int):
        self.services = services
        self.worker_id = worker_id
        self.capabilities = capabilities
        self.queues = queues
        self.slots = slots
        self.interval = registry_heartbeat_interval(services.settings)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)

    def register(self) -> None:
        from workers.compiling.drain import DRAIN
        from workers.liveness import LIVENESS

        with transaction(self.services.sessions) as session:
            registry.register(session, self.worker_id, socket.gethostname(), self.capabilities, self.queues,
                              self.slots)
            if DRAIN.draining or LIVENESS.stopping.is_set():  # re-registered while draining: still draining
                registry.mark_draining(session, self.worker_id)
            # In the registration's transaction: the first worker of a release claims its policies' runs.
            claims = policies.claim(session, self.worker_id, self.capabilities)
        if claims:  # a thread: a campaign of many artifacts must not hold up the heartbeats or the consuming
            threading.Thread(target=start_policy_campaigns, args=(self.services, claims), name="policy-campaigns",
                             daemon=True).start()

    def mark_draining(self) -> None:
        try:
            with transaction(self.services.sessions) as session:
                registry.mark_draining(session, self.worker_id)
        except Exception as exc:  # the UI shows it a beat later, or never; the drain itself goes on
            log.warning("could not mark the worker draining", extra={"error": f"{type(exc).__name__}: {exc}"})

    def _run(self) -> None:
        from workers.compiling.drain import DRAIN
        from workers.liveness import LIVENESS

        while not self.stop.wait(self.interval):
            try:
                with transaction(self.services.sessions) as session:
                    beat = registry.heartbeat(session, self.worker_id)
                if beat is None:
                    log.warning("registry row missing or marked stopped: registering again")
                    self.register()
                elif beat.draining and not DRAIN.draining and not LIVENESS.stopping.is_set():
                    # Not this process's own drain (that sets DRAIN before writing): another process (the
                    # relay, finding work this worker does not take) told it to stop through the ledger.
                    LIVENESS.stop("told to stop through the ledger (workers.draining_at set by another process)")
            except Exception as exc:  # the database is away; running compiles have their own leases
                log.warning("registry heartbeat failed", extra={"error": f"{type(exc).__name__}: {exc}"})


def start_policy_campaigns(services: Services, claims: list[policies.Claim]) -> None:
    """The campaigns of the standing roll-forward policies this worker's registration fired (it is the first
    worker of a new release): submitted like an operator's, their compiles queued for the new release
    (other targets' workers of it may not be up yet). A failure is the run's note; the worker starts."""
    from compilesvc.builds.policy_submits import policy_submit
    from compilesvc.builds.submit import Submitter

    submit = policy_submit(Submitter(services))
    for claimed in claims:
        try:
            policies.start_claimed(services.sessions, claimed, submit)
        except Exception:  # start_claimed notes its own failures; this is the ledger gone meanwhile
            log.exception("could not start a roll-forward policy's campaign", extra={"policy_id": claimed.policy_id})


class ToolchainRefused(click.ClickException):
    """The host's Neuron toolchain or environment is not the release it claims (docs/neuron-hosts.md)."""

    exit_code = 78  # EX_CONFIG (sysexits.h): configuration error


class SandboxRefused(click.ClickException):
    """Compiles cannot be isolated on this host and the operator did not say they are isolated otherwise."""

    exit_code = 78  # EX_CONFIG, as for a refused toolchain: a restart does not help until the host is fixed


def _check_sandbox(settings: Settings) -> int | None:
    """Start a sandboxed interpreter as a compile would (workers.isolation.sandbox), or refuse to start. In
    the pod split, the Neuron devices of the compile container (where compiles run; None: this host's)."""
    from workers.compiling.workdirs import work_root
    from workers.isolation.child_env import child_environment
    from workers.isolation.sandbox import Policy, SandboxUnavailable, probe

    try:
        policy = Policy.from_settings(settings)
        if settings.sandbox == "pod":
            return _check_compile_runner(settings, policy)
        if not policy.enabled:
            log.warning("compile sandbox is off (COMPILESVC_SANDBOX=off): compiles run as this worker's user, "
                        "with its files and network; isolate this worker another way (docs/deploy.md)")
            return None
        with tempfile.TemporaryDirectory(prefix="sandbox-probe-", dir=work_root()) as scratch:
            probe(policy, child_environment(os.environ), Path(scratch))
        _check_sandbox_egress(settings, policy)
    except SandboxUnavailable as exc:
        log.error("refusing to start", extra={"detail": str(exc)})
        raise SandboxRefused(f"refusing to start: {exc}") from None
    log.info("compile sandbox ready", extra={"sandbox": "bwrap", "user": policy.user if os.geteuid() == 0 else None})
    return None


def _check_sandbox_egress(settings: Settings, policy: Any) -> None:
    """bwrap mode: the egress proof (workers.isolation.egress) from inside the sandbox, once at start. Every
    compile gets the same bubblewrap argv and so a fresh network namespace of its own, which nothing outside
    the process can change later (unlike a pod's NetworkPolicy): one proof per start covers them."""
    from workers.compiling.workdirs import work_root
    from workers.isolation import egress
    from workers.isolation.child_env import child_environment
    from workers.isolation.sandbox import SandboxUnavailable

    environ = {egress.CANARIES_ENV: settings.egress_canaries,
               egress.ACKNOWLEDGED_ENV: "1" if settings.egress_acknowledged else ""}
    with tempfile.TemporaryDirectory(prefix="egress-probe-", dir=work_root()) as scratch:
        refused = egress.sandbox_refusal(policy, child_environment(os.environ), Path(scratch), environ)
    if refused:
        raise SandboxUnavailable(refused)
    if settings.egress_acknowledged:
        log.warning("EGRESS ACKNOWLEDGED (COMPILESVC_EGRESS_ACKNOWLEDGED=1): compiles are not refused if "
                    "their network reaches a canary")


def _check_compile_runner(settings: Settings, policy: Any) -> int:
    """COMPILESVC_SANDBOX=pod: the spool is there and the pod's compile runner answers a probe attempt; the
    Neuron devices its container has (the chart gives them to the compile container, not to this one)."""
    from workers.isolation.sandbox import SandboxUnavailable
    from workers.isolation.spool_process import SpoolUnavailable, probe, sweep_spool

    if settings.compile_spool is None:
        raise SandboxUnavailable("COMPILESVC_SANDBOX=pod needs COMPILESVC_COMPILE_SPOOL, the directory shared "
                                 "with the compile container (docs/deploy.md, 'Compile isolation')")
    try:
        swept = sweep_spool(settings.compile_spool)
        if swept:
            log.info("removed leftovers from the compile spool", extra={"entries": swept})
        devices = probe(settings.compile_spool, policy.limits, pickup_seconds=settings.compile_runner_pickup_seconds,
                        stale_seconds=settings.compile_runner_stale_seconds)
    except (SpoolUnavailable, OSError) as exc:
        raise SandboxUnavailable(f"the pod's compile runner does not answer ({exc}); start it beside this worker "
                                 "(python -m workers.isolation.compile_runner --spool "
                                 f"{settings.compile_spool})") from None
    log.info("compile runner ready", extra={"sandbox": "pod", "spool": str(settings.compile_spool),
                                            "neuron_devices": devices})
    return devices


def _drain_on_shutdown(settings: Settings, beat: RegistryHeartbeat) -> None:
    """Celery's warm shutdown (SIGTERM, or a first SIGINT) starts the drain; a cold one (SIGQUIT, a second
    SIGINT) kills the compiles with the worker, and their leases bring them back. A worker already draining
    (a spot notice, which then sends itself SIGTERM to stop consuming) keeps its window."""
    from celery.signals import worker_shutting_down

    from workers.compiling.drain import DRAIN

    def drain(sig: str = "", how: str = "", **_: Any) -> None:
        if how == "Warm" and not DRAIN.draining and DRAIN.begin(settings.drain_seconds, f"told to stop ({sig})"):
            # Runs inside the signal handler: the registry write goes to a thread.
            threading.Thread(target=beat.mark_draining, name="mark-draining", daemon=True).start()

    worker_shutting_down.connect(drain, weak=False)


def _drain_on_spot_notice(settings: Settings, beat: RegistryHeartbeat) -> None:
    """On a spot interruption notice: drain with the spot window, then stop as if told to (a SIGTERM to
    ourselves starts Celery's warm shutdown: no new compile; its drain keeps the earlier deadline)."""
    from celery.signals import worker_ready

    from workers.compiling.drain import DRAIN
    from workers.host.spot import SpotWatcher

    def notice(action: str, when: str) -> None:
        log.warning("spot interruption notice", extra={"action": action, "time": when})
        if DRAIN.begin(settings.spot_drain_seconds, f"reclaimed by EC2 ({action} at {when})"):
            beat.mark_draining()
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = SpotWatcher(settings.imds_url, notice)

    # Watched once Celery handles SIGTERM: a notice before that would find the default action (death).
    @worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
    def _start(**_: Any) -> None:
        watcher.start()


def _check_alive() -> None:
    """``--check-alive``: read the liveness file (compilesvc/liveness.py); exit 0 alive, 1 not, 2 bad settings."""
    from compilesvc import liveness
    from workers.liveness import liveness_path

    try:
        settings = Settings()
    except ValidationError as exc:
        raise click.UsageError(f"invalid COMPILESVC_* settings: {exc}") from None
    status = liveness.check(liveness_path(settings))
    click.echo(("alive: " if status.alive else "not alive: ") + status.detail, err=not status.alive)
    sys.exit(0 if status.alive else 1)


def default_worker_name() -> str:
    return f"compilesvc-{os.getpid()}@{socket.gethostname()}"


@click.command("worker")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=2, show_default=True,
              help="Compiles run at once (one pool process each).")
@click.option("--queues", "-Q", default=None,
              help="Comma-separated queues to consume (default: every queue this host's capabilities serve).")
@click.option("--name", "-n", default=None, help="Worker id in the registry and Celery node name "
              "(default: compilesvc-<pid>@<hostname>).")
@click.option("--loglevel", "-l", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--pool", type=click.Choice(["threads"]), default="threads", show_default=True,
              help="Celery pool: threads only. A task only supervises its compiler's own process, so threads "
                   "suffice; and the drain, --max-compiles and the pod's annotations live in this one process, "
                   "which a prefork pool's children would not share.")
@click.option("--max-compiles", type=click.IntRange(min=1), default=None,
              help="Stop (draining, as on SIGTERM) once this many compiles have ended here: 1 for a Kubernetes "
                   "Job per compile (the Helm chart's ScaledJob mode).")
@click.option("--check-alive", is_flag=True,
              help="Start nothing: exit 0 if this host's worker proves it consumes (its liveness file, "
                   "COMPILESVC_LIVENESS_FILE), 1 if not, with one line saying why. For liveness probes.")
def worker(concurrency: int, queues: str | None, name: str | None, loglevel: str, pool: str,
           max_compiles: int | None, check_alive: bool) -> None:
    """Run a compile worker for the targets this host can compile."""
    from workers.host.capabilities import capability_queues, detect_capabilities

    if check_alive:
        _check_alive()

    worker_id = name or default_worker_name()
    # `kill -USR1 <pid>` prints every thread's Python stack to the log: the first thing to look at when a
    # worker or one of its pool processes (which inherit this) seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    jsonlog.configure(loglevel.upper(), service="worker", static={"worker": worker_id})
    try:
        settings = Settings()
    except ValidationError as exc:
        raise click.UsageError(f"invalid COMPILESVC_* settings: {exc}") from None
    capabilities = detect_capabilities(devices=_check_sandbox(settings))
    capabilities["sandbox"] = settings.sandbox
    refused = (capabilities.get("neuron") or {}).get("refused") or []
    if refused:
        # The host claims a Neuron release its packages or environment contradict: serving anything would
        # hide that (an operator expects Neuron work here), and serving Neuron would publish artifacts under
        # keys that lie. Exit 78 (EX_CONFIG): a restart does not help until the host is fixed.
        for problem in refused:
            log.error("refusing to start", extra={"detail": problem})
        raise ToolchainRefused("refusing to start: " + "; ".join(refused))
    for warning in capabilities.get("warnings", []):
        log.warning("capability", extra={"detail": warning})
    queue_list = ([q.strip() for q in queues.split(",") if q.strip()] if queues
                  else capability_queues(capabilities))
    if not queue_list:
        raise click.UsageError("this host can compile nothing (no torch, no Neuron SDK); see the warnings above")

    # Import the app (and so the task) only now: the settings above were validated with a clear message.
    from workers import tasks
    from workers.celery_app import worker_app
    from workers.compiling.runner import sweep_orphaned_attempts

    protection = None
    if settings.kubernetes_protect:
        from workers.host.pod_protection import PodProtection

        try:
            protection = PodProtection.from_environment().start()
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    tasks.configure(worker_id, max_compiles, protection)
    swept = sweep_orphaned_attempts()
    if swept:
        log.info("removed directories of attempts whose worker died", extra={"directories": swept})
    services = Services.from_settings(settings)
    _ = services.signer  # a signing key that cannot be used stops the start, not the first publish
    beat = RegistryHeartbeat(services, worker_id, capabilities, queue_list, concurrency)
    from workers.liveness import EXIT_NOT_CONSUMING, LIVENESS, canary_queue, install

    # Stopping to be restarted: say so in the registry (admission and the queue depths count it out).
    monitor = install(settings, worker_id, concurrency, lambda: threading.Thread(
        target=beat.mark_draining, name="mark-draining", daemon=True).start())
    beat.register()
    beat.thread.start()
    log.info("worker registered", extra={"queues": queue_list, "slots": concurrency})
    nodename = worker_id if "@" in worker_id else f"{worker_id}@%h"
    # --quiet drops Celery's multi-line banner on stdout: every line a worker prints is JSON, and the
    # "worker registered" line above already names the queues and slots. No gossip, mingle or event
    # heartbeats: the ledger is the registry (RegistryHeartbeat), and the broker user may not publish events.
    # The canary's queue is consumed, never registered (workers/liveness.py).
    consumed = ",".join([*queue_list, canary_queue(worker_id)])
    argv = ["--quiet", "worker", "-Q", consumed, "-c", str(concurrency), "--prefetch-multiplier=1",
            "-n", nodename, "--without-gossip", "--without-mingle", "--without-heartbeat", "-O", "fair",
            "-l", loglevel.upper(), "--pool", pool]
    _drain_on_shutdown(settings, beat)
    if settings.spot_notice:
        _drain_on_spot_notice(settings, beat)
    exit_code: int | None = None
    try:
        exit_code = worker_app().worker_main(argv)
    finally:
        monitor.stop_event.set()
        beat.stop.set()
        beat.thread.join(5)
        try:
            with transaction(services.sessions) as session:
                registry.mark_stopped(session, worker_id)
        except Exception:  # the row ages out anyway
            log.exception("could not mark the worker stopped")
        services.close()
        if LIVENESS.stopping.is_set():
            exit_code = EXIT_NOT_CONSUMING  # for the supervisor to start a fresh one (workers/liveness.py)
        log.info("worker stopped", extra={"exit_code": exit_code})
    sys.exit(exit_code or 0)


if __name__ == "__main__":  # pragma: no cover - `python -m workers.cli` without the entry point
    worker()
