"""The egress proof (workers.isolation.egress) with real processes and a real canary: a socket this test
listens on at 127.0.0.1, standing for the API, ledger, broker or S3 endpoint.

Pod mode: the compile runner as its container runs it (tests/workers/isolation/test_pod_split.py's Runner).
Where `unshare --net` is refused (RuntimeDefault seccomp without CAP_SYS_ADMIN, as on EKS) a fake `unshare`
that fails stands in, so the compile shares the runner's network and reaches the canary: the runner refuses
(exit 78, naming it). bwrap mode: the host reaches the canary, the sandbox a compile gets does not.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compilesvc.config.settings import Settings
from tests.workers.isolation.test_pod_split import Runner
from workers.isolation import egress
from workers.isolation.child_env import child_environment
from workers.isolation.sandbox import Mounts, Policy, Sandbox
from workers.isolation.spool_process import SpoolUnavailable, probe

LIMITS = Policy.from_settings(Settings(sandbox="pod")).limits


@pytest.fixture
def canary() -> Iterator[socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield listener
    listener.close()


def closed_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return int(free.getsockname()[1])


@pytest.fixture
def no_netns(tmp_path: Path) -> dict[str, str]:
    """PATH with an `unshare` that is refused, as under RuntimeDefault seccomp without CAP_SYS_ADMIN."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    return {"PATH": f"{fake}:{os.environ['PATH']}"}


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


def started(spool: Path, env: dict[str, str]) -> Runner:
    return Runner(spool, extra_env=env)


def output_of(runner: Runner) -> tuple[int, str]:
    out, _ = runner.proc.communicate(timeout=60)
    return runner.proc.returncode, out.decode()


def test_canaries_parse_and_an_unresolvable_name_is_unreachable() -> None:
    assert egress.parse_canaries(" api:8080, [::1]:5432,,db.internal:6379") == [
        ("api", 8080), ("::1", 5432), ("db.internal", 6379)]
    for bad in ("api", "api:", ":80", "api:http", "api:70000"):
        with pytest.raises(ValueError, match="not host:port"):
            egress.parse_canaries(bad)
    assert egress.resolve([("no-such-host.invalid", 80)]) == []
    assert egress.reached([egress.Target("x:1", "127.0.0.1", closed_port())]) == []


def test_the_runner_refuses_when_the_compile_s_network_reaches_a_canary(
        spool: Path, canary: socket.socket, no_netns: dict[str, str]) -> None:
    port = canary.getsockname()[1]
    closed = closed_port()
    runner = started(spool, {**no_netns, egress.CANARIES_ENV: f"127.0.0.1:{port},localhost:{closed}"})
    code, out = output_of(runner)
    assert code == 78
    assert f"reached 127.0.0.1:{port} " in out and f"localhost:{closed}" not in out.split("reached")[1].split("(")[0]
    assert "NetworkPolicy" in out and egress.ACKNOWLEDGED_ENV in out
    assert not (spool / "runner" / "heartbeat").exists()  # refused before it said it was ready


def test_the_runner_compiles_when_no_canary_answers(spool: Path, no_netns: dict[str, str]) -> None:
    runner = started(spool, {**no_netns, egress.CANARIES_ENV: f"127.0.0.1:{closed_port()},no-such-host.invalid:5432"})
    try:
        probe(spool, LIMITS, pickup_seconds=20, stale_seconds=10)  # an attempt the runner runs end to end
        assert runner.proc.poll() is None
    finally:
        runner.kill()


def test_a_canary_that_opens_later_stops_the_next_compile(spool: Path, no_netns: dict[str, str]) -> None:
    port = closed_port()
    runner = started(spool, {**no_netns, egress.CANARIES_ENV: f"127.0.0.1:{port}"})
    listener = socket.socket()
    try:
        probe(spool, LIMITS, pickup_seconds=20, stale_seconds=10)
        listener.bind(("127.0.0.1", port))
        listener.listen(4)
        with pytest.raises(SpoolUnavailable, match=f"reached 127.0.0.1:{port}"):
            probe(spool, LIMITS, pickup_seconds=20, stale_seconds=10)
        code, out = output_of(runner)
        assert code == 78 and f"refusing to compile: the compile's network reached 127.0.0.1:{port}" in out
    finally:
        listener.close()
        runner.kill()


def test_the_acknowledgement_compiles_with_a_warning(spool: Path, canary: socket.socket,
                                                     no_netns: dict[str, str]) -> None:
    runner = started(spool, {**no_netns, egress.CANARIES_ENV: f"127.0.0.1:{canary.getsockname()[1]}",
                             egress.ACKNOWLEDGED_ENV: "1"})
    try:
        probe(spool, LIMITS, pickup_seconds=20, stale_seconds=10)
        assert runner.proc.poll() is None
    finally:
        runner.kill()
    _, out = output_of(runner)
    assert out.count("EGRESS ACKNOWLEDGED") >= 2  # at start and at the compile


def _unshare_works() -> bool:
    return subprocess.run(["unshare", "--user", "--map-current-user", "--net", "--", "true"],
                          capture_output=True, timeout=10, check=False).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged network namespaces here")
def test_the_runner_s_own_namespace_passes_the_proof(spool: Path, canary: socket.socket) -> None:
    """Where `unshare --net` works, the canary the runner's container reaches is not the compile's to reach."""
    port = canary.getsockname()[1]
    assert egress.reached(egress.resolve([("127.0.0.1", port)])) == [f"127.0.0.1:{port}"]  # the container's view
    runner = started(spool, {egress.CANARIES_ENV: f"127.0.0.1:{port}"})
    try:
        probe(spool, LIMITS, pickup_seconds=20, stale_seconds=10)
    finally:
        runner.kill()


@pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="bubblewrap is not installed")
def test_the_bwrap_sandbox_does_not_reach_what_the_host_reaches(tmp_path: Path, canary: socket.socket) -> None:
    port = canary.getsockname()[1]
    targets = egress.resolve([("127.0.0.1", port), ("localhost", port)])
    assert egress.reached(targets) == [f"127.0.0.1:{port}", f"localhost:{port}"]  # the host reaches it
    policy = Policy.from_settings(Settings())
    env = child_environment(os.environ)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    sandbox = Sandbox(policy, Mounts(writable=[scratch]), env)
    sandbox.hand_over()
    began = time.monotonic()
    inside = egress.reached_from(sandbox.argv([], scratch), targets, env=sandbox.environment(scratch), cwd="/")
    took = time.monotonic() - began
    assert inside == []  # the sandbox's own network namespace: its loopback is not the host's
    print(f"sandboxed egress probe: {took:.3f}s")
    listening = {egress.CANARIES_ENV: f"127.0.0.1:{port}"}
    assert egress.sandbox_refusal(policy, env, scratch, listening) is None


def test_a_probe_that_cannot_run_is_no_proof(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="did not run in the compile's network"):
        egress.reached_from(["false"], [egress.Target("x:1", "127.0.0.1", 1)])
    missing = Policy(enabled=True, user=None, limits=LIMITS, bwrap=str(tmp_path / "no-bwrap"))
    assert egress.sandbox_refusal(missing, {}, tmp_path, {egress.CANARIES_ENV: "127.0.0.1:1"}) is not None


@pytest.fixture
def no_sandbox_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `bwrap` that runs the command after `--` without any namespace: a sandbox that leaks the network."""
    fake = tmp_path / "leaky"
    fake.mkdir()
    (fake / "bwrap").write_text('#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n')
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


@pytest.mark.parametrize("acknowledged", [False, True], ids=["refused", "acknowledged"])
def test_a_bwrap_worker_whose_sandbox_reaches_a_canary_refuses_to_start(
        canary: socket.socket, no_sandbox_bwrap: None, acknowledged: bool, caplog: pytest.LogCaptureFixture) -> None:
    from workers.cli import SandboxRefused, _check_sandbox

    port = canary.getsockname()[1]
    settings = Settings(sandbox="bwrap", egress_canaries=f"127.0.0.1:{port}", egress_acknowledged=acknowledged)
    if acknowledged:
        assert _check_sandbox(settings) is None
        assert "EGRESS ACKNOWLEDGED" in caplog.text
        return
    with pytest.raises(SandboxRefused, match=f"reached 127.0.0.1:{port}") as refused:
        _check_sandbox(settings)
    assert refused.value.exit_code == 78 and "NetworkPolicy" in str(refused.value)


@pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="bubblewrap is not installed")
def test_a_bwrap_worker_starts_when_its_sandbox_reaches_no_canary(canary: socket.socket, tmp_path: Path) -> None:
    from workers.cli import _check_sandbox

    # data_dir outside the checkout, as tests/workers/conftest.py does: the sandbox binds the checkout then.
    settings = Settings(sandbox="bwrap", data_dir=tmp_path / "data",
                        egress_canaries=f"127.0.0.1:{canary.getsockname()[1]}")
    assert _check_sandbox(settings) is None
