"""Dispatch to Celery: queue names, routing, the shared Celery configuration and the outbox relay's sender.

A compile's queue is decided once, at submit (:func:`queue_name`), stored on the bucket compile and carried
in its dispatch message; Celery's own ``task_routes`` (:func:`route_task`) sends the message there.

- cpu: by target and torch release (``compile.cpu.2.13.0``), AOTInductor also by the ISA the native code
  is built for (``compile.cpu.2.13.0.x86_64-avx512``).
- Neuron: by target, toolchain and kind of compile (``compile.inf2.2.27.0.trace``). The release in the
  name is the oldest one shipping the same toolchain for that kind of compile
  (:func:`compilesvc.spec.neuron_toolchain.toolchain_release`), since keys hold the toolchain: 2.27.0 and 2.27.1
  compiles share keys and therefore one queue, which workers of either release consume. The kinds are
  ``neuronx-cc`` (HLO; ``neuronx-cc-tp`` for tp > 1), ``trace`` and ``trace-tp`` (tp > 1, which adds
  neuronx-distributed): :data:`compilesvc.spec.neuron_kinds.KIND_PACKAGES`.

The settings here are for hours-long tasks on a Redis broker: late acks, prefetch 1, a visibility timeout
above the hard time limit everywhere Celery reads it. The ledger's leases, not Celery redelivery, recover
crashed work.

Time limits: the compile itself is bounded by the runner (``compile_timeout_seconds``: SIGTERM to the
compiler's process group, then SIGKILL), which is what classifies a timeout and retries it. Celery's soft
and hard limits sit above that as a backstop; Celery enforces them only in the prefork pool, not in the
thread pool workers use by default, where the runner's limit is the only one.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from compilesvc.config.settings import Settings
from compilesvc.dispatch import fs_broker
from compilesvc.spec.neuron_kinds import compile_kind
from compilesvc.spec.neuron_toolchain import toolchain_release

COMPILE_TASK = "compilesvc.compile_bucket"


def queue_name(target: str, sdk: str, backend: str, isa: str | None = None, tp_degree: int = 1) -> str:
    """The queue a compile for ``target``/``sdk`` goes to (and a capable worker consumes)."""
    if target == "cpu":
        name = f"compile.{target}.{sdk}"
        if backend == "aotinductor" and isa:
            name += f".{isa}"
        return name
    return f"compile.{target}.{toolchain_release(sdk, backend, tp_degree)}.{compile_kind(backend, tp_degree)}"


def task_id(bucket_compile_id: int, dispatch: int) -> str:
    """Deterministic Celery task id: a re-sent outbox row never becomes a second task id."""
    return f"bucket-{bucket_compile_id}-dispatch-{dispatch}"


def route_task(name: str, args: Any, kwargs: dict[str, Any] | None, options: Any, task: Any = None,
               **_: Any) -> dict[str, str] | None:
    """Celery router: a compile task goes to the queue its bucket compile was given at submit."""
    if name == COMPILE_TASK and kwargs:
        queue = kwargs.get("queue")
        if queue:
            return {"queue": queue}
        # A message written before queues were carried (an outbox row from an older release)
        return {"queue": queue_name(kwargs["target"], kwargs["sdk"], kwargs["backend"], kwargs.get("isa"))}
    return None


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery configuration shared by the producer (relay, API) and the workers."""
    broker_url = settings.resolved_broker_url
    transport_options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout_seconds}
    if is_redis_url(broker_url):
        transport_options.update({
            # Without a socket timeout a publish to a Redis that vanished without closing the connection
            # waits forever, and the API request that relays after commit with it.
            "socket_timeout": settings.broker_socket_timeout_seconds,
            "socket_connect_timeout": settings.broker_socket_timeout_seconds,
            # kombu scans the unacked set every interval x throttle seconds; a throttle of 1 makes the
            # setting the whole period.
            "unacked_restore_interval": settings.broker_unacked_restore_seconds,
            "unacked_restore_throttle": 1,
        })
        if settings.broker_key_prefix:
            # In the one config every producer and worker reads: a prefix on only one side strands messages.
            transport_options["global_keyprefix"] = settings.broker_key_prefix
    if broker_url.startswith("filesystem://"):
        folder = settings.broker_folder
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            # Broadcast (pidbox) files default to ./control in the working directory.
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": 0.05,
        }
    return {
        "broker_url": broker_url,
        # A filesystem:// broker's messages are written whole before the consumer can see them (fs_broker).
        "broker_transport": fs_broker.TRANSPORT if broker_url.startswith("filesystem://") else None,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "result_backend": None,
        "task_ignore_result": True,
        "task_routes": (route_task,),
        "task_acks_late": True,
        "task_reject_on_worker_lost": False,
        "worker_prefetch_multiplier": 1,
        # Deliberately off. A running compile belongs to its lease in the ledger, not to a broker connection:
        # a reconnect must not kill hours of work (and the thread pool cannot terminate a task anyway). Its
        # message stays unacked; if Redis redelivers it, the claim finds nothing to do.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_time_limit": settings.task_hard_limit_seconds,
        "task_soft_time_limit": settings.task_hard_limit_seconds - 300,
        "visibility_timeout": settings.visibility_timeout_seconds,
        "result_backend_transport_options": {"visibility_timeout": settings.visibility_timeout_seconds},
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_hijack_root_logger": False,
        "task_create_missing_queues": True,
    }


def is_redis_url(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://"))


def make_producer(settings: Settings) -> Celery:
    """A Celery app used only to send (the relay and the API); workers build their own in workers/."""
    app = Celery("compilesvc-producer", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app
