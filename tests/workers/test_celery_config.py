"""The Celery configuration workers and producers run with: the settings that make hours-long tasks safe
on a Redis broker (REFERENCE: acks late, prefetch 1, a visibility timeout above the hard limit everywhere
Celery reads it), and routing by target and SDK."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from compilesvc.config.settings import Settings
from compilesvc.dispatch.routing import COMPILE_TASK, make_producer, queue_name
from workers.celery_app import make_app


def redis_settings(tmp_path: Path, **overrides: object) -> Settings:
    return Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0", **overrides)  # type: ignore[arg-type]


def test_worker_config_is_safe_for_hours_long_tasks(tmp_path: Path) -> None:
    settings = redis_settings(tmp_path, compile_timeout_seconds=4 * 3600)
    conf = make_app(settings).conf
    assert conf.task_acks_late is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_reject_on_worker_lost is False  # the lease and reaper recover crashed work, not Celery
    # Our own subprocess timeout fires first (and is classified); Celery's limits sit above it.
    assert settings.compile_timeout_seconds < conf.task_soft_time_limit < conf.task_time_limit
    # Redis redelivers an unacked message after the visibility timeout: it must outlive the hard limit in
    # every place Celery reads it, or a long compile is delivered twice.
    for timeout in (conf.broker_transport_options["visibility_timeout"],
                    conf.result_backend_transport_options["visibility_timeout"], conf.visibility_timeout):
        assert timeout > conf.task_time_limit
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is False  # see compilesvc.dispatch.routing
    assert conf.task_ignore_result is True and conf.worker_send_task_events is False
    assert conf.worker_enable_remote_control is False  # nothing broadcasts; the worker's Redis user has no pub/sub


def test_compiles_go_to_the_queue_decided_at_submit(tmp_path: Path) -> None:
    app = make_producer(redis_settings(tmp_path))
    route = app.amqp.router.route
    kwargs = {"target": "inf2", "sdk": "2.27.1", "backend": "trace", "bucket_compile_id": 1, "isa": None,
              "queue": "compile.inf2.2.27.0.trace"}
    assert route({}, COMPILE_TASK, kwargs=kwargs)["queue"].name == "compile.inf2.2.27.0.trace"
    # A message from before queues were carried is routed by the same rule submit uses.
    legacy = {k: v for k, v in kwargs.items() if k != "queue"}
    assert route({}, COMPILE_TASK, kwargs=legacy)["queue"].name == queue_name("inf2", "2.27.1", "trace")
    aoti = {**legacy, "target": "cpu", "sdk": "2.13.0", "backend": "aotinductor", "isa": "x86_64-avx512"}
    assert route({}, COMPILE_TASK, kwargs=aoti)["queue"].name == "compile.cpu.2.13.0.x86_64-avx512"


def test_releases_with_one_toolchain_share_queues() -> None:
    """2.27.0 and 2.27.1 ship identical packages (so identical keys): one queue per kind of compile, named
    by the older release; a release with another toolchain has its own."""
    for backend, tp_degree, kind in (("neuronx-cc", 1, "neuronx-cc"), ("trace", 1, "trace"), ("trace", 4, "trace-tp")):
        shared = {queue_name("trn2", sdk, backend, tp_degree=tp_degree) for sdk in ("2.27.0", "2.27.1")}
        assert shared == {f"compile.trn2.2.27.0.{kind}"}
        assert queue_name("trn2", "2.26.0", backend, tp_degree=tp_degree) == f"compile.trn2.2.26.0.{kind}"


def test_broker_key_prefix_reaches_producers_and_workers_alike(tmp_path: Path) -> None:
    settings = redis_settings(tmp_path, broker_key_prefix="team-a:")
    for conf in (make_producer(settings).conf, make_app(settings).conf):
        assert conf.broker_transport_options["global_keyprefix"] == "team-a:"
    filesystem = Settings(data_dir=tmp_path, broker_key_prefix="team-a:")  # kombu's filesystem: no such option
    assert "global_keyprefix" not in make_producer(filesystem).conf.broker_transport_options


def test_broker_timings_are_settings_and_reach_every_process(tmp_path: Path) -> None:
    settings = redis_settings(tmp_path, compile_timeout_seconds=3600, broker_visibility_timeout_seconds=9000,
                              broker_unacked_restore_seconds=30, broker_socket_timeout_seconds=4)
    for conf in (make_app(settings).conf, make_producer(settings).conf):
        options = conf.broker_transport_options
        assert options["visibility_timeout"] == conf.visibility_timeout == 9000
        assert (options["unacked_restore_interval"], options["unacked_restore_throttle"]) == (30, 1)
        assert options["socket_timeout"] == options["socket_connect_timeout"] == 4


@pytest.mark.parametrize("margin", [-3000, 0])
def test_a_visibility_timeout_at_or_below_the_hard_limit_is_refused(tmp_path: Path, margin: int) -> None:
    # The hard limit covers the compile and the store retries of fetch and publish: at or below it, Redis
    # would deliver a running compile's message a second time.
    hard = redis_settings(tmp_path, compile_timeout_seconds=3600, store_retry_seconds=900).task_hard_limit_seconds
    assert hard == 3600 + 2 * 900 + 600
    with pytest.raises(ValidationError, match="must exceed the hard task limit"):
        redis_settings(tmp_path, compile_timeout_seconds=3600, store_retry_seconds=900,
                       broker_visibility_timeout_seconds=hard + margin)
    assert redis_settings(tmp_path, compile_timeout_seconds=3600, store_retry_seconds=900,
                          broker_visibility_timeout_seconds=hard + 1).visibility_timeout_seconds == hard + 1


def test_backoff_bounds_are_consistent(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="retry_backoff_max_seconds"):
        redis_settings(tmp_path, retry_backoff_seconds=60, retry_backoff_max_seconds=10)
