"""The compile sandbox against hostile code: what a compile child can reach, do and exhaust.

The payloads here are plain Python run exactly where a compile child runs (:class:`CompilerProcess` in the
:class:`Sandbox` the runner builds: the same bubblewrap command line, user, mounts, environment and limits).
They stand for what a model could do if a model format or a toolchain bug handed it arbitrary code (the
formats themselves give less: tests/attacks/ submits TorchScript models through the API). Each test names
the boundary it checks; docs/security.md's threat model points here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import pytest

from compilesvc.config.settings import Settings
from compilesvc.states import ErrorClass
from workers.compiling.classify import Outcome
from workers.compiling.sandbox_limits import limit_outcome
from workers.isolation.child_env import child_environment
from workers.isolation.compiler_process import CompilerProcess
from workers.isolation.sandbox import Mounts, Policy, Sandbox, SandboxUnavailable, probe

pytestmark = pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="bubblewrap is not installed")

AS_ROOT = os.geteuid() == 0


class Collect:
    """The child's output, as the runner's log stream would get it."""

    def __init__(self) -> None:
        self.text = ""

    def pump(self, stream: IO[bytes]) -> None:
        self.text = stream.read().decode(errors="replace")

    def result(self) -> dict[str, Any]:
        last = [line for line in self.text.splitlines() if line.startswith("{")]
        assert last, self.text
        return dict(json.loads(last[-1]))


class Attempt:
    """One attempt's directories, laid out as the runner lays them (workers.compiling.workdirs)."""

    def __init__(self, root: Path):
        self.job = root / "job"
        self.model = self.job / "model"
        self.work = root / "work"
        self.out = self.job / "out"
        for directory in (self.model, self.work, self.out):
            directory.mkdir(parents=True)
        (self.model / "model.pt").write_bytes(b"model bytes")
        self.request = self.job / "request.json"
        self.request.write_text("{}")

    def mounts(self) -> Mounts:
        return Mounts(read_only=[self.model, self.request], writable=[self.work, self.out])


@pytest.fixture
def policy() -> Policy:
    return Policy.from_settings(Settings(sandbox_max_processes=64, sandbox_memory_mb=1024,
                                         sandbox_max_file_mb=8, sandbox_max_disk_mb=32, sandbox_tmp_mb=16))


@pytest.fixture
def attempt(tmp_path: Path) -> Attempt:
    return Attempt(tmp_path / "attempt")


@pytest.fixture
def secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Secrets where a worker keeps them: its environment, its home, the embedded default's data dir."""
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = AKIA-home-secret\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "admin-token").write_text("csvc_admin-token-secret")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-env-secret")
    monkeypatch.setenv("COMPILESVC_DATABASE_URL", "postgresql://svc:ledger-password-secret@db/compilesvc")
    yield {"home": str(home), "data": str(data), "token": "csvc_admin-token-secret",
           "aws": "AKIA-home-secret", "env": "aws-env-secret", "ledger": "ledger-password-secret"}


def run(policy: Policy, attempt: Attempt, code: str, *, timeout: float = 60,
        secret_paths: tuple[Path, ...] = ()) -> tuple[Collect, CompilerProcess, int, bool]:
    """Run ``code`` as the compile child of ``attempt`` would run (same sandbox, env and limits)."""
    policy = replace(policy, secret_paths=policy.secret_paths + secret_paths)
    env = child_environment(os.environ, "cpu")
    sink = Collect()
    child = CompilerProcess([sys.executable, "-c", code], cwd=attempt.work, env=env, logs=sink,
                            sandbox=Sandbox(policy, attempt.mounts(), env))
    returncode, timed_out = child.wait(timeout, threading.Event(), grace=1)
    return sink, child, returncode, timed_out


# -- what it can see --------------------------------------------------------------------------------------

def test_no_secret_of_the_worker_is_readable(policy: Policy, attempt: Attempt, secrets: dict[str, str]) -> None:
    """Environment, home, data dir, the worker's /proc: none reachable, none in anything the child prints."""
    code = f"""
import json, os
seen = {{"env": dict(os.environ), "proc": sorted(p for p in os.listdir("/proc") if p.isdigit())}}
for path in ["{secrets['home']}/.aws/credentials", "{secrets['data']}/admin-token", "/proc/1/environ",
             "/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ", "/etc/shadow", "/root/.bash_history"]:
    try:
        seen[path] = open(path, errors="replace").read()
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps(seen))
"""
    sink, _, returncode, _ = run(policy, attempt, code, secret_paths=(Path(secrets["data"]),))
    assert returncode == 0, sink.text
    for value in ("token", "aws", "env", "ledger"):
        assert secrets[value] not in sink.text
    seen = sink.result()
    assert not [name for name in seen["env"] if name.startswith(("COMPILESVC_DATABASE", "AWS_"))]
    assert seen[f"{secrets['home']}/.aws/credentials"] == "FileNotFoundError"
    assert seen[f"{secrets['data']}/admin-token"] == "FileNotFoundError"
    assert seen["/etc/shadow"] == "FileNotFoundError"
    # Its own PID namespace: bubblewrap's init and itself; the worker's pid is not there.
    assert len(seen["proc"]) <= 3 and str(os.getpid()) not in seen["proc"]


def test_the_filesystem_holds_the_toolchain_and_its_own_directories_only(policy: Policy, attempt: Attempt) -> None:
    checkout = Path(__file__).resolve().parents[3]
    code = f"""
import json, os
def tried(path, data=b"x"):
    try:
        with open(path, "wb") as fh:
            fh.write(data)
        return "written"
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({{
    "uid": os.getuid(), "root": sorted(os.listdir("/")), "checkout": sorted(os.listdir("{checkout}")),
    "model": tried("{attempt.model}/model.pt"), "request": tried("{attempt.request}"),
    "toolchain": tried("{checkout}/workers/evil.py"), "etc": tried("/etc/evil"),
    "work": tried("{attempt.work}/scratch"), "out": tried("{attempt.out}/model.pt"),
    "dev": sorted(os.listdir("/dev")),
}}))
"""
    sink, _, returncode, _ = run(policy, attempt, code)
    assert returncode == 0, sink.text
    seen = sink.result()
    if AS_ROOT:
        assert seen["uid"] == 65534  # `nobody`: another user than the worker's
    # Of a checkout, only the two packages (and the virtualenv): never its data dir (.compilesvc).
    assert set(seen["checkout"]) <= {"compilesvc", "workers", ".venv"}
    assert seen["model"] == seen["request"] == "OSError"  # read-only (EROFS)
    assert seen["toolchain"] == "OSError" and seen["etc"] in ("OSError", "PermissionError")
    assert seen["work"] == seen["out"] == "written"
    assert (attempt.model / "model.pt").read_bytes() == b"model bytes"
    assert not (checkout / "workers" / "evil.py").exists()
    assert not [node for node in seen["dev"] if node.startswith(("sd", "vd", "nvme", "mem", "kmsg"))]


def test_no_network_not_even_the_hosts_loopback(policy: Policy, attempt: Attempt) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
import json, socket
out = {{}}
for host in ("127.0.0.1", "10.0.0.1", "169.254.169.254"):  # the host, a private range, the metadata service
    try:
        socket.create_connection((host, {port} if host == "127.0.0.1" else 80), timeout=2).close()
        out[host] = "connected"
    except OSError as exc:
        out[host] = type(exc).__name__
print(json.dumps(out))
"""
    try:
        sink, _, returncode, _ = run(policy, attempt, code)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert returncode == 0, sink.text
    assert "connected" not in sink.result().values()


def test_it_cannot_signal_the_worker(policy: Policy, attempt: Attempt) -> None:
    code = f"""
import json, os, signal
out = {{}}
for pid in ({os.getpid()}, {os.getppid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        out[str(pid)] = "sent"
    except OSError as exc:
        out[str(pid)] = type(exc).__name__
print(json.dumps(out))
"""
    sink, _, returncode, _ = run(policy, attempt, code)
    assert returncode == 0, sink.text
    assert "sent" not in sink.result().values()


# -- what it can exhaust ----------------------------------------------------------------------------------

def outcome_of(sink: Collect, child: CompilerProcess, returncode: int, policy: Policy) -> Outcome:
    """What the runner would record (an unexplained exit of the child, then the sandbox's limits)."""
    failed = Outcome(ErrorClass.UNKNOWN, f"EXIT_{returncode}", "failed")
    return limit_outcome(failed, child.limit, returncode, sink.text.splitlines()[-40:], policy.limits)


def test_a_fork_bomb_stops_at_the_process_limit_and_the_worker_forks_on(policy: Policy, attempt: Attempt) -> None:
    code = """
import os, time
children = []
while True:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    children.append(pid)
"""
    sink, child, returncode, timed_out = run(policy, attempt, code, timeout=60)
    assert not timed_out and returncode != 0
    assert outcome_of(sink, child, returncode, policy).code == "SANDBOX_PROCESS_LIMIT", sink.text[-2000:]
    pid = os.fork()  # the worker is not the one limited
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_filling_the_disk_is_stopped_at_the_disk_limit(policy: Policy, attempt: Attempt) -> None:
    code = f"""
import os, time
for n in range(100):  # 4 MiB files, each under the file-size limit; 400 MiB in all if nobody stops it
    with open("{attempt.work}/fill-%d" % n, "wb") as fh:
        fh.write(os.urandom(4 << 20))
    time.sleep(0.05)
"""
    sink, child, returncode, _ = run(policy, attempt, code)
    outcome = outcome_of(sink, child, returncode, policy)
    assert (outcome.error_class, outcome.code) == (ErrorClass.COMPILE, "SANDBOX_DISK_LIMIT"), sink.text[-2000:]
    written = sum(p.stat().st_size for p in attempt.work.iterdir())
    assert written < 100 << 20  # stopped within about a second of the 32 MiB limit


def test_one_file_past_the_file_size_limit(policy: Policy, attempt: Attempt) -> None:
    code = f"""
with open("{attempt.out}/model.neff", "wb") as fh:
    fh.write(b"x" * (16 << 20))
"""
    sink, child, returncode, _ = run(policy, attempt, code)
    assert outcome_of(sink, child, returncode, policy).code == "SANDBOX_FILE_SIZE_LIMIT", sink.text[-2000:]


def test_memory_past_the_limit(policy: Policy, attempt: Attempt) -> None:
    sink, child, returncode, _ = run(policy, attempt, "x = bytearray(2 << 30)")
    assert outcome_of(sink, child, returncode, policy).code == "SANDBOX_MEMORY_LIMIT", sink.text[-2000:]


def test_the_private_tmp_is_bounded(policy: Policy, attempt: Attempt) -> None:
    code = """
try:
    for n in range(8):  # 4 MiB files (under the file-size limit), 32 MiB in all
        with open("/tmp/fill-%d" % n, "wb") as fh:
            fh.write(b"x" * (4 << 20))
    print("written")
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""
    sink, _, returncode, _ = run(policy, attempt, code)
    assert returncode == 0 and "written" not in sink.text and "28" in sink.text  # ENOSPC at 16 MiB


def test_past_the_time_limit_the_whole_sandbox_dies(policy: Policy, attempt: Attempt) -> None:
    marker = attempt.work / "still-alive"
    loop = f"import time, pathlib\\nwhile True:\\n    pathlib.Path('{marker}').touch()\\n    time.sleep(0.2)"
    code = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "{loop}"], start_new_session=True)  # leaves the child's group
time.sleep(300)
"""
    _, _, _, timed_out = run(policy, attempt, code, timeout=3)
    assert timed_out
    marker.unlink(missing_ok=True)
    threading.Event().wait(1.0)
    assert not marker.exists(), "a process of the sandbox outlived it"


# -- where it cannot be had -------------------------------------------------------------------------------

def test_the_worker_refuses_to_start_without_bubblewrap(policy: Policy, tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="COMPILESVC_SANDBOX=off"):
        probe(replace(policy, bwrap="no-such-bwrap"), child_environment(os.environ), tmp_path / "scratch")


def test_an_unknown_sandbox_user_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match="no such user"):
        Policy.from_settings(Settings(sandbox_user="no-such-user-here"))


def test_a_sandbox_that_cannot_start_is_refused_with_the_reason(policy: Policy, tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="No permissions to creating new namespace"):
        probe(replace(policy, bwrap=str(fake)), child_environment(os.environ), tmp_path / "scratch")


def test_signals_reported_by_bubblewrap_read_as_signals(policy: Policy, attempt: Attempt) -> None:
    sink, _, returncode, _ = run(policy, attempt, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert returncode == -signal.SIGKILL, sink.text


def test_the_memory_limit_is_the_workers_own_or_none_where_the_compile_has_a_container_of_its_own(
        tmp_path: Path) -> None:
    """Unset, a compile's address space is what the worker may use (its cgroup's limit inside a container,
    compilesvc.hostinfo); under the pod split the compile runs in another container, whose own limit binds it:
    the worker's smaller one must not (issue 30's review)."""
    from compilesvc.hostinfo import host_memory_bytes
    from tests.fixtures.settings import make_settings

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    bwrap = Policy.from_settings(make_settings(tmp_path, url, sandbox="bwrap")).limits
    assert (bwrap.memory_bytes, bwrap.memory_set) == (host_memory_bytes(), False)
    pod = Policy.from_settings(make_settings(tmp_path, url, sandbox="pod", compile_spool=tmp_path / "spool")).limits
    assert (pod.memory_bytes, pod.memory_set) == (None, False)
    chosen = Policy.from_settings(make_settings(tmp_path, url, sandbox="pod", compile_spool=tmp_path / "spool",
                                                sandbox_memory_mb=512)).limits
    assert (chosen.memory_bytes, chosen.memory_set) == (512 * 1024 * 1024, True)


def test_orchestrator_secrets_are_never_bound_whatever_the_settings_add(tmp_path: Path) -> None:
    """Docker's /run/secrets and Kubernetes' service-account token (/var/run/secrets) hold credentials: an
    operator's COMPILESVC_SANDBOX_READ_PATHS naming a directory above them binds nothing (issue 30's review)."""
    from tests.fixtures.settings import make_settings
    from workers.isolation.sandbox import holds_secret

    extra = tmp_path / "models-cache"
    extra.mkdir()
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}",
                             sandbox_read_paths=f"/run,/var,{extra}")
    policy = Policy.from_settings(settings)
    assert holds_secret(Path(os.path.realpath("/var/run/secrets")), policy.secret_paths)
    assert holds_secret(Path("/run"), policy.secret_paths) and not holds_secret(extra, policy.secret_paths)
    argv = Sandbox(policy, Mounts(), child_environment(os.environ)).argv([sys.executable, "-c", "pass"], tmp_path)
    bound = {argv[i + 1] for i, arg in enumerate(argv) if arg in ("--ro-bind", "--bind", "--ro-bind-try")}
    assert str(extra) in bound
    assert not {"/run", "/var", os.path.realpath("/var/run")} & bound
