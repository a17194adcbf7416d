"""The consuming check (workers/liveness.py) and the liveness file a probe reads (compilesvc/liveness.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from compilesvc import liveness
from compilesvc.config.settings import Settings
from workers import liveness as worker_liveness
from workers.liveness import CanaryMonitor, Liveness, canary_queue


def _monitor(tmp_path: Path, send: object, concurrency: int = 1) -> tuple[CanaryMonitor, Liveness, list[str]]:
    settings = Settings(liveness_check_seconds=0.05, liveness_bound_seconds=0.3,
                        liveness_file=tmp_path / "w.alive")
    state = Liveness()
    stopped: list[str] = []
    monitor = CanaryMonitor(settings, "w1@test", concurrency, send,  # type: ignore[arg-type]
                            lambda: stopped.append("stopped"), liveness=state)
    return monitor, state, stopped


def test_a_canary_that_arrives_proves_consuming(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_liveness, "reserved", lambda: 0)
    sent: list[str] = []
    received = Liveness()

    def send(queue: str) -> None:
        sent.append(queue)
        received.received()

    monitor, state, stopped = _monitor(tmp_path, send)
    monitor.liveness = received
    monitor._check()
    state = received
    assert sent == ["compile.canary.w1-test"] and not stopped and not state.stopping.is_set()
    assert liveness.check(tmp_path / "w.alive") == liveness.Status(True, "alive")


def test_a_canary_that_never_arrives_stops_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_liveness, "reserved", lambda: 0)
    monitor, state, stopped = _monitor(tmp_path, lambda queue: None)
    started = time.monotonic()
    monitor._check()
    assert time.monotonic() - started >= 0.3  # it waited the bound
    assert state.stopping.is_set() and stopped == ["stopped"]
    assert "no message received within 0.3 s" in state.why


def test_with_every_slot_busy_the_check_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_liveness, "reserved", lambda: 2)
    monitor, state, _ = _monitor(tmp_path, lambda queue: pytest.fail("a canary sent with no free slot"),
                                       concurrency=2)
    monitor._check()
    assert not state.stopping.is_set()
    status = liveness.check(tmp_path / "w.alive")
    assert status.alive and status.detail.startswith("busy: 2 of 2 slots busy")


def test_a_broker_that_is_away_is_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_liveness, "reserved", lambda: 0)

    def refused(queue: str) -> None:
        raise ConnectionError("Connection refused")

    monitor, state, _ = _monitor(tmp_path, refused)
    monitor._check()
    assert not state.stopping.is_set() and liveness.check(tmp_path / "w.alive").alive


def test_any_message_counts_not_only_the_canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that took the free slot meanwhile proves consuming as well as the canary would."""
    monkeypatch.setattr(worker_liveness, "reserved", lambda: 0)
    monitor, state, _ = _monitor(tmp_path, lambda queue: None)
    import threading

    threading.Timer(0.1, state.received).start()
    monitor._check()
    assert not state.stopping.is_set()


def test_the_file_says_dead_when_stale_gone_or_said(tmp_path: Path) -> None:
    path = tmp_path / "x.alive"
    assert not liveness.check(path).alive and "no liveness file" in liveness.check(path).detail
    writer = liveness.LivenessFile(path)
    writer.write("alive", 5)
    assert liveness.check(path).alive
    assert not liveness.check(path, now=time.time() + 6).alive
    writer.write("dead", 60, "exited 75: no canary")
    assert liveness.check(path).detail.endswith("exited 75: no canary") and not liveness.check(path).alive
    writer.write("stopping", 60, "2 compiles finishing")
    assert liveness.check(path).alive  # its compiles finish; the probe must not kill them
    body = json.loads(path.read_text())
    body["pid"] = _dead_pid()
    path.write_text(json.dumps(body))
    assert "is not running" in liveness.check(path).detail
    path.write_text("{not json")
    assert "unreadable" in liveness.check(path).detail
    with pytest.raises(ValueError):
        writer.write("sleepy", 1)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert proc.pid != os.getpid()
    return proc.pid


def test_check_alive_command_reads_the_file(tmp_path: Path) -> None:
    """`compilesvc worker --check-alive`: 0 alive, 1 not, one line why (the probes of compose and the chart)."""
    from click.testing import CliRunner

    from workers.cli import worker

    path = tmp_path / "w.alive"
    env = {"COMPILESVC_LIVENESS_FILE": str(path)}
    result = CliRunner().invoke(worker, ["--check-alive"], env=env)
    assert result.exit_code == 1 and "not alive" in result.output and "no liveness file" in result.output
    liveness.LivenessFile(path).write("alive", 30)
    result = CliRunner().invoke(worker, ["--check-alive"], env=env)
    assert result.exit_code == 0 and result.output.strip() == "alive: alive"


def test_the_canary_queue_is_covered_by_the_broker_users_rules() -> None:
    """docker/redis/users.sh grants the queues as ~compile.*: a canary queue is one of them."""
    rules = (Path(__file__).parents[2] / "docker" / "redis" / "users.sh").read_text()
    assert "QUEUES='~compile.*'" in rules and canary_queue("w1@host").startswith("compile.")


def test_the_canary_queue_is_a_name_the_embedded_broker_accepts() -> None:
    """kombu's filesystem transport takes only A-Za-z0-9._- in an exchange name; worker ids hold '@'."""
    import re

    assert canary_queue("compilesvc-123@my host") == "compile.canary.compilesvc-123-my-host"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", canary_queue("w1@test"))
