"""The workers' Celery app: the shared configuration of :func:`compilesvc.dispatch.routing.celery_config` and
worker-only settings. The app is built on first use (:func:`worker_app`); the task in :mod:`workers.tasks`
is a shared task, so it binds to whichever app runs it.

Celery is only the doorbell here. Which compile runs, how often, and who owns it is decided by the
ledger's leases (:mod:`compilesvc.compiles.leases`); so redelivery, result storage and task events are all off or
as cheap as possible, and nothing depends on Celery remembering anything.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import Celery

from compilesvc.config.settings import Settings
from compilesvc.dispatch.routing import celery_config

WORKER_ONLY_CONFIG: dict[str, Any] = {
    # Reserve no more messages than there are free slots: a reserved-but-not-started message would wait
    # behind an hours-long compile while another worker sits idle.
    "worker_prefetch_multiplier": 1,
    "worker_disable_rate_limits": True,
    # No events or results: the ledger is the record (and Flower would keep only 10,000 tasks anyway).
    "worker_send_task_events": False,
    # No remote control either: nothing sends workers commands (a cancel goes through the ledger, and the
    # registry is the ledger's), and without it a worker's Redis user needs no pub/sub and no binding scripts
    # (docker/redis/users.sh). With --without-heartbeat and --without-gossip (workers/cli.py) the worker
    # publishes no events at all.
    "worker_enable_remote_control": False,
    "task_send_sent_event": False,
    "task_track_started": False,
    # Our runner logs JSON itself; don't turn stray prints into WARNING records.
    "worker_redirect_stdouts": False,
    # Keep reconnecting to the broker for as long as it takes; running compiles are unaffected.
    "broker_connection_retry": True,
    "broker_connection_max_retries": None,
}


def make_app(settings: Settings | None = None) -> Celery:
    """A worker's Celery app, configured from ``settings`` (default: the environment)."""
    settings = settings or Settings()
    app = Celery("compilesvc-worker", include=["workers.tasks"])
    app.conf.update(celery_config(settings))
    app.conf.update(WORKER_ONLY_CONFIG)
    return app


@functools.cache
def worker_app() -> Celery:
    """This process's worker app, built on first use (not at import: importing the tasks must not read
    the environment's settings, and a bad setting is reported by ``compilesvc worker`` first)."""
    return make_app()
