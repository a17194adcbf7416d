"""``compilesvc relay``: the relay + reaper loop process, and plumbing shared by long-running processes.

The loop relays unsent outbox rows every ``relay_interval_seconds`` (the API relays its own rows right
after commit; this catches what a crash or a broker outage left behind), runs the reaper
(:mod:`compilesvc.compiles.reaper`) every ``reap_interval`` and, every few minutes, has the store remove abandoned
uploads (:meth:`compilesvc.store.ArtifactStore.sweep_incomplete_uploads`) and starts the campaigns of standing
roll-forward policies whose worker died before it could (:func:`compilesvc.lifecycle.policies.start_stalled`)
and submits what operators' campaigns whose API request died left (:func:`compilesvc.lifecycle.resume.resume_stalled`).
With ``COMPILESVC_RELAY_METRICS_PORT`` set it serves the metrics each reaper pass sets
(:mod:`compilesvc.cli.relay_metrics`); a port it cannot bind stops the start with exit status 1.
Any number of these processes may run: outbox rows and expired leases are taken with ``SKIP LOCKED``, a
policy run gets one campaign however many relays start it (a unique index), and a campaign's item is
submitted once (a claim). SIGTERM/SIGINT finish the current
pass and exit 0.

Its log lines are :mod:`compilesvc.jsonlog`'s, as every process's are.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import click
from pydantic import ValidationError

from compilesvc import jsonlog
from compilesvc.access import idempotency
from compilesvc.access.tokens import Principal
from compilesvc.builds.policy_submits import campaign_submit, policy_submit
from compilesvc.builds.submit import Submitter
from compilesvc.cli.relay_metrics import RelayMetrics, serve
from compilesvc.compiles.reaper import ReapReport, reap
from compilesvc.compiles.reconcile import Reconciler, broker_view
from compilesvc.compiles.unclaimed import UnclaimedWatch
from compilesvc.config.settings import Settings
from compilesvc.dispatch.outbox import OutboxRelay
from compilesvc.ledger.engine import transaction
from compilesvc.lifecycle import policies, resume
from compilesvc.lifecycle.campaigns import SubmitDocument
from compilesvc.liveness import LivenessFile, default_path
from compilesvc.notify.webhooks import Sender
from compilesvc.services import Services
from compilesvc.store import StoreError

log = logging.getLogger("compilesvc.relay")

# -- the loop ---------------------------------------------------------------------------------------------

def default_reap_interval(settings: Settings) -> float:
    """Often enough that a dead worker's compile is back in the queue soon after its lease ends."""
    return max(settings.relay_interval_seconds, min(5.0, settings.lease_seconds / 2))


def upload_sweep_interval(settings: Settings) -> float:
    """A listing of the bucket's open uploads every few minutes at most, yet several times per threshold,
    so an abandoned upload outlives ``abandoned_upload_seconds`` by a fraction of it."""
    return max(settings.relay_interval_seconds, min(300.0, settings.abandoned_upload_seconds / 4))


class RelayLoop:
    """Relay every ``relay_interval`` seconds, reap every ``reap_interval``; stops when ``stop`` is set."""

    def __init__(self, services: Services, relay: OutboxRelay, *, reap_interval: float | None = None):
        self.services = services
        self.relay = relay
        self.relay_interval = services.settings.relay_interval_seconds
        self.reap_interval = reap_interval or default_reap_interval(services.settings)
        self.sweep_interval = upload_sweep_interval(services.settings)
        self.stop = threading.Event()
        self._stale: set[str] = set()
        self._submitter: Submitter | None = None
        self.policy_grace = policies.START_GRACE_SECONDS
        settings = services.settings
        self.reconciler = Reconciler(services.sessions, broker_view(settings, services.producer),
                                     settings.dispatch_grace_seconds)
        self.watch = UnclaimedWatch(services.sessions, unclaimed_after=settings.unclaimed_after_seconds,
                                    stale_seconds=settings.worker_stale_seconds)
        self.metrics = RelayMetrics()
        self.liveness = LivenessFile(settings.liveness_file or default_path("relay"))
        self.liveness_seconds = settings.relay_liveness_seconds
        self.webhooks = Sender(services.sessions, secret=settings.resolved_webhook_secret,
                               public_url=settings.public_url, allowed=settings.webhook_networks,
                               max_attempts=settings.webhook_max_attempts,
                               backoff_seconds=settings.webhook_retry_seconds,
                               backoff_max_seconds=settings.retry_backoff_max_seconds)

    def run_once(self, *, with_reap: bool = True) -> ReapReport | None:
        if not with_reap:
            sent = self.relay.relay_all()
            if sent:
                log.info("relayed outbox rows", extra={"sent": sent})
            return None
        started = time.monotonic()
        try:
            report = reap(self.services, relay=self.relay, reconciler=self.reconciler, watch=self.watch)
        except Exception:
            self.metrics.failed(time.monotonic() - started)
            raise
        self.metrics.passed(report, time.monotonic() - started)
        if report.changed:
            log.info("reaper pass", extra={
                "requeued": report.requeued, "failed": report.failed, "cancelled": report.cancelled,
                "published": report.published, "resent": report.resent, "relayed": report.relayed,
            })
        stale = set(report.stale_workers)
        if stale - self._stale:  # report each worker going silent once, not every pass
            log.warning("workers stopped heartbeating", extra={"workers": sorted(stale - self._stale)})
        self._stale = stale
        return report

    def sweep_uploads(self) -> int:
        """Remove the uploads the store began and nobody finished; a store outage only postpones this."""
        older_than = timedelta(seconds=self.services.settings.abandoned_upload_seconds)
        try:
            removed = self.services.store.sweep_incomplete_uploads(older_than)
        except StoreError as exc:  # the store is down: the next sweep retries
            log.warning("upload sweep failed", extra={"error": str(exc)})
            return 0
        except Exception:  # housekeeping must not stop the relay
            log.exception("upload sweep failed")
            return 0
        if removed:
            log.info("removed abandoned uploads", extra={"removed": removed})
        return removed

    def sweep_idempotency_keys(self) -> int:
        """Delete expired Idempotency-Keys (an expired key is ignored anyway; this keeps the table small)."""
        try:
            with transaction(self.services.sessions) as session:
                removed = idempotency.delete_expired(session, self.services.settings.idempotency_key_seconds)
        except Exception:  # the ledger is down: the next sweep retries
            log.exception("idempotency key sweep failed")
            return 0
        if removed:
            log.info("removed expired idempotency keys", extra={"removed": removed})
        return removed

    def start_stalled_policy_runs(self) -> int:
        """Start the campaigns of policy runs whose worker died between claiming and starting them."""
        submit = policy_submit(self._submitter_once())
        return self._campaign_pass("policy run", "started stalled roll-forward policy runs",
                                   lambda: policies.start_stalled(self.services.sessions, submit, self.policy_grace))

    def resume_campaigns(self) -> int:
        """Submit the items of operators' campaigns whose API request died mid-loop, as that request would have."""
        submitter = self._submitter_once()

        def submit_as(principal: Principal | None, queue_anyway: bool) -> SubmitDocument:
            return campaign_submit(submitter, principal, queue_anyway=queue_anyway)

        return self._campaign_pass("campaign resume", "resumed campaigns whose starter died",
                                   lambda: resume.resume_stalled(self.services.sessions, submit_as, self.policy_grace))

    def _submitter_once(self) -> Submitter:
        if self._submitter is None:
            self._submitter = Submitter(self.services)
        return self._submitter

    @staticmethod
    def _campaign_pass(name: str, done_message: str, run: Callable[[], list[int]]) -> int:
        """One relay pass over campaigns; how many it started or resumed. A failed pass (the ledger down) is
        logged and retried by the next."""
        try:
            campaigns = run()
        except Exception:
            log.exception("%s pass failed", name)
            return 0
        if campaigns:
            log.info(done_message, extra={"campaigns": campaigns})
        return len(campaigns)

    def _sweep_loop(self) -> None:
        while True:
            self.sweep_uploads()
            self.sweep_idempotency_keys()
            self.start_stalled_policy_runs()
            self.resume_campaigns()
            if self.stop.wait(self.sweep_interval):
                return

    def deliver_webhooks(self) -> int:
        """Send the webhook deliveries that are due; a ledger outage only postpones them."""
        try:
            return self.webhooks.deliver_due()
        except Exception:  # housekeeping of its own: must not stop the relay
            log.exception("webhook pass failed")
            return 0

    def _webhook_loop(self) -> None:
        while not self.stop.is_set():
            if not self.deliver_webhooks():
                self.stop.wait(self.relay_interval)

    def run(self) -> None:
        # The sweep and the webhooks get threads of their own: a store that hangs or a receiver that answers
        # slowly can take minutes, and relaying, reaping and reconciling must go on meanwhile.
        sweeper = threading.Thread(target=self._sweep_loop, name="upload-sweep", daemon=True)
        sweeper.start()
        notifier = threading.Thread(target=self._webhook_loop, name="webhooks", daemon=True)
        notifier.start()
        next_reap = 0.0
        failures = 0
        self.liveness.write("starting", self.liveness_seconds, "first pass")
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                self.run_once(with_reap=now >= next_reap)
                failures = 0
            except Exception:  # database or broker down: keep the process, back off, try again
                failures += 1
                log.exception("relay pass failed", extra={"consecutive_failures": failures})
            if now >= next_reap:
                next_reap = now + self.reap_interval
            wait = min(self.relay_interval * (2 ** min(failures, 5)), 30.0)
            # Alive = the loop comes round, failing or not (a restart does not bring a ledger back); a pass hung
            # on a socket no timeout sees stops these writes, and the probe restarts the process.
            self.liveness.write("alive", self.liveness_seconds + wait,
                                f"{failures} pass(es) failed in a row" if failures else "")
            self.stop.wait(wait)
        sweeper.join(5)
        notifier.join(5)


@click.command("relay")
@click.option("--once", is_flag=True, help="Run one relay and reaper pass, then exit.")
@click.option("--reap-interval", type=click.FloatRange(min=0.1), default=None,
              help="Seconds between reaper passes (default: half the lease, at most 5).")
@click.option("--loglevel", "-l", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def relay(once: bool, reap_interval: float | None, loglevel: str) -> None:
    """Relay unsent dispatch messages to the broker and recover abandoned compiles (the reaper)."""
    jsonlog.configure(loglevel.upper(), service="relay")
    try:
        settings = Settings()
    except ValidationError as exc:
        raise click.UsageError(f"invalid COMPILESVC_* settings: {exc}") from None
    services = Services.from_settings(settings, pre_ping=True)
    _ = services.signer  # a signing key that cannot be used stops the start, not the first publish
    loop = RelayLoop(services, services.relay, reap_interval=reap_interval)
    metrics_port = None
    if settings.relay_metrics_port is not None and not once:
        try:
            metrics_port = serve(loop.metrics, settings.relay_metrics_bind, settings.relay_metrics_port).server_port
        except OSError as exc:  # the port is taken or the address is not this host's: say so, exit 1
            services.producer.close()
            services.close()
            raise click.ClickException(f"cannot serve metrics on {settings.relay_metrics_bind}:"
                                       f"{settings.relay_metrics_port}: {exc.strerror or exc}") from None

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        loop.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("relay started", extra={"relay_interval": loop.relay_interval, "reap_interval": loop.reap_interval,
                                     "pid": os.getpid(), "metrics_port": metrics_port})
    try:
        if once:
            loop.run_once()
            loop.sweep_uploads()
            loop.sweep_idempotency_keys()
            loop.start_stalled_policy_runs()
            loop.resume_campaigns()
            loop.deliver_webhooks()
        else:
            loop.run()
    finally:
        services.producer.close()
        services.close()
        log.info("relay stopped")


if __name__ == "__main__":  # pragma: no cover - `python -m compilesvc.cli.daemon` without the entry point
    relay()
