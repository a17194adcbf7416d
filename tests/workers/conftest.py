"""Fixtures that run the real thing: ``compilesvc worker`` and ``compilesvc relay`` processes on the test's
Postgres ledger, a Redis broker isolated per test, and a local (or S3) artifact store.

Isolation on a shared Redis: every test gets its own kombu ``global_keyprefix`` (the ``broker_key_prefix``
setting, which every process of the cluster reads), so concurrent test runs on one machine never consume
each other's tasks, and a message a test leaves behind (a killed worker's unacked task) never reaches the
next test. The keys are deleted when the test ends.

The Neuron SDK is the TEST DOUBLE in ``tests/doubles/neuron`` (see ``tests/doubles/__init__.py``); its
behaviour is chosen per compile with the ``--double-behaviour=...`` compiler flag. Its ``hlo`` path
(backend ``neuronx-cc``) needs no torch in the child, which keeps slow/crash/error tests fast; the cpu
target runs the real torchscript backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from sqlalchemy import select

from compilesvc.builds.submit import SubmitResult, Submitter
from compilesvc.config.settings import Settings
from compilesvc.ledger.models import Artifact, BucketCompile, Event
from compilesvc.services import Services
from compilesvc.spec.parsing import parse_spec
from tests.doubles import neuron_double_env
from tests.doubles.compiler_flags import DOUBLE_FLAGS_SETTING
from tests.fixtures.ports import free_port
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.fixtures.waiting import wait_for

REDIS_URL = os.environ.get("COMPILESVC_TEST_REDIS", "redis://127.0.0.1:6379/0")
COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
NEURON_SDK = "2.20.0"
#: The "model" of :meth:`Cluster.hlo_spec`: the Neuron double's compiler does not read it.
HLO_MODEL = b"HloModuleProto (a test double does not read it)"


@dataclass
class ServiceProcess:
    """A ``compilesvc`` subprocess in its own session, logging JSON lines to ``log_path``."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def logged(self, msg: str, **fields: Any) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("msg") == msg and all(r.get(k) == v for k, v in fields.items())]

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait for the line a worker ("worker ready") or relay ("relay started") logs once it is serving."""
        wait_for(lambda: self.logged("worker ready") or self.logged("relay started") or self.proc.poll() is not None,
                 timeout, f"{self.name} to be ready")
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]

    def kill_group(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the whole process group (the main process and its pool processes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill_group(signal.SIGKILL)  # whatever is left of the group
        if self.proc.poll() is None:
            self.proc.wait(10)


@dataclass
class Cluster:
    """One test's service: settings shared by this process and the subprocesses it starts."""

    tmp: Path
    env: dict[str, str]
    settings: Settings
    services: Services
    processes: list[ServiceProcess] = field(default_factory=list)

    # -- processes ----------------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None) -> ServiceProcess:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([COMPILESVC, *argv], env={**self.env, **(env or {})}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp)
        service = ServiceProcess(name, proc, log_path)
        self.processes.append(service)
        return service

    def start_worker(self, name: str, concurrency: int = 2, env: dict[str, str] | None = None,
                     wait: bool = True) -> ServiceProcess:
        worker = self._start(name, ["worker", "-c", str(concurrency), "-n", f"{name}@test", "-l", "INFO"], env)
        if wait:
            worker.wait_ready()
        return worker

    def start_relay(self, env: dict[str, str] | None = None, wait: bool = True) -> ServiceProcess:
        relay = self._start("relay", ["relay", "-l", "INFO"], env)
        if wait:
            relay.wait_ready()
        return relay

    def start_api(self, port: int, workers: int = 2, env: dict[str, str] | None = None,
                  timeout: float = 60) -> ServiceProcess:
        """``compilesvc serve`` (gunicorn) on 127.0.0.1:``port``; returns once ``/readyz`` answers 200."""
        api = self._start("api", ["serve", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
                          env)

        def ready() -> bool:
            if api.proc.poll() is not None:
                raise AssertionError(f"the API exited with {api.proc.returncode}: "
                                     f"{api.log_path.read_text(errors='replace')[-3000:]}")
            try:
                return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        wait_for(ready, timeout, "the API to be ready", interval=0.2)
        return api

    def start_service(self, concurrency: int = 2) -> int:
        """A worker, the relay and one API process: the service as a CI job or a fleet host meets it. Returns
        the API's port, which its download URLs name (``COMPILESVC_PUBLIC_URL``)."""
        self.start_worker("w1", concurrency=concurrency)
        self.start_relay()
        port = free_port()
        self.start_api(port, workers=1, env={"COMPILESVC_PUBLIC_URL": f"http://127.0.0.1:{port}"})
        return port

    @staticmethod
    def client_env(port: int, tmp: Path) -> dict[str, str]:
        """A CLI client's environment for the API on ``port``: the caller's, with no service setting, the
        bootstrap token and no config file."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_"))}
        env.update({"COMPILESVC_API_URL": f"http://127.0.0.1:{port}", "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN,
                    "COMPILESVC_CONFIG": str(tmp / "no-config.toml")})
        return env

    def dump_stacks(self) -> None:
        """SIGUSR1 to every process of every group: workers print all Python stacks (faulthandler)."""
        for process in self.processes:
            if process.proc.poll() is None:
                process.kill_group(signal.SIGUSR1)
        time.sleep(0.5)

    def kill_all(self) -> None:
        """Test teardown: nothing needs a graceful stop any more (test_pipeline checks that one once)."""
        for process in self.processes:
            process.kill_group(signal.SIGKILL)
        for process in self.processes:
            process.proc.wait(10)

    # -- work ---------------------------------------------------------------------------------------

    def upload(self, content: bytes, name: str = "model.bin") -> str:
        path = self.tmp / name
        path.write_bytes(content)
        return f"blob:sha256:{self.services.store.put_file(path).sha256}"

    def submit(self, doc: dict[str, Any], **kwargs: Any) -> SubmitResult:
        return Submitter(self.services).submit(parse_spec(doc, extra_flags=self.settings.extra_flags), **kwargs)

    def hlo_spec(self, behaviour: str = "ok", buckets: int = 1, uri: str | None = None,
                 **extra: Any) -> dict[str, Any]:
        """A spec for the Neuron double's neuronx-cc path (no torch in the child: fast). ``uri``: a model
        uploaded already (default: :data:`HLO_MODEL` put in the store)."""
        uri = uri or self.upload(HLO_MODEL, "model.hlo.pb")
        return {
            "model": {"uri": uri, "format": "hlo", "name": "double"},
            "target": "inf2", "sdk": NEURON_SDK,
            "compiler": {"args": [f"--double-behaviour={behaviour}"]},
            "buckets": [{"batch_size": 1, "seq_len": 16 * (i + 1)} for i in range(buckets)],
            **extra,
        }

    def bucket(self, key: str) -> BucketCompile:
        with self.services.sessions() as session:
            return session.scalars(select(BucketCompile).where(BucketCompile.key == key)).one()

    def artifact(self, key: str) -> Artifact:
        with self.services.sessions() as session:
            return session.scalars(select(Artifact).where(Artifact.key == key)).one()

    def wait_bucket(self, key: str, states: tuple[str, ...], timeout: float = 60) -> BucketCompile:
        def check() -> BucketCompile | None:
            bucket = self.bucket(key)
            return bucket if bucket.state in states else None
        return wait_for(check, timeout, f"bucket {key[:12]} to reach {states} (now {self.bucket(key).state})")

    def wait_artifact(self, key: str, states: tuple[str, ...], timeout: float = 60) -> Artifact:
        def check() -> Artifact | None:
            artifact = self.artifact(key)
            return artifact if artifact.state in states else None
        return wait_for(check, timeout, f"artifact {key[:12]} to reach {states}")

    def transitions(self, bucket_id: int) -> list[tuple[str | None, str]]:
        with self.services.sessions() as session:
            rows = session.execute(
                select(Event.from_state, Event.to_state)
                .where(Event.entity == "bucket", Event.entity_id == bucket_id).order_by(Event.id)
            ).all()
        return [(a, b) for a, b in rows]


def _clean_environ() -> dict[str, str]:
    """This process's environment without any COMPILESVC_*/AWS_* the developer's shell may carry (nor the
    inductor cache directory importing torch here sets)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}


@pytest.fixture
def broker_prefix() -> Iterator[str]:
    prefix = f"compilesvc-test-{os.getpid()}-{uuid.uuid4().hex[:10]}:"
    yield prefix
    delete_redis_keys(prefix)


def delete_redis_keys(prefix: str) -> int:
    """Delete every Redis key under ``prefix`` (a test's or a bench's broker); returns how many."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()


@contextlib.contextmanager
def cluster_factory(tmp_path: Path, request: pytest.FixtureRequest,
                    **defaults: Any) -> Iterator[Callable[..., Cluster]]:
    """``make(store_url=None, extra_env=None, **settings)`` -> a :class:`Cluster` whose settings are
    :data:`CLUSTER_DEFAULTS`, then ``defaults`` (where its ledger and broker are), then ``settings``; they
    become ``COMPILESVC_*`` variables. Every process a cluster started is killed on exit (after a stack
    dump into its log when the test failed)."""
    clusters: list[Cluster] = []

    def make(store_url: str | None = None, extra_env: dict[str, str] | None = None, **overrides: Any) -> Cluster:
        values: dict[str, Any] = {
            "data_dir": str(tmp_path / "data"),
            "store_url": store_url or (tmp_path / "store").as_uri(),
            **CLUSTER_DEFAULTS,
            **defaults,
            **overrides,
        }
        env = neuron_double_env(_clean_environ(), sdk=NEURON_SDK)
        env.update({f"COMPILESVC_{k.upper()}": str(v).lower() if isinstance(v, bool) else
                    json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in values.items()})
        env.update(extra_env or {})
        settings = Settings(**values)
        services = Services.from_settings(settings)
        cluster = Cluster(tmp=tmp_path, env=env, settings=settings, services=services)
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        failed = getattr(request.node, "report_call", None) is not None and request.node.report_call.failed
        for cluster in clusters:
            if failed:  # leave every process's stacks in its log (tmp_path) for the post-mortem
                cluster.dump_stacks()
            cluster.kill_all()
            cluster.services.producer.close()
            cluster.services.close()


#: Short timings, so that lost leases and dead workers are noticed within seconds.
CLUSTER_DEFAULTS: dict[str, Any] = {
    "secret_key": "test-secret-key",
    "bootstrap_token": BOOTSTRAP_TOKEN,  # the API's admin, for the clients of the tests
    "lease_seconds": 3,
    "heartbeat_seconds": 0.5,
    "worker_stale_seconds": 10,
    "relay_interval_seconds": 0.2,
    "max_attempts": 3,
    "require_live_worker": True,
    "extra_compiler_flags": DOUBLE_FLAGS_SETTING,  # the API accepts the double's --double-behaviour
}


@pytest.fixture
def make_cluster(tmp_path: Path, pg_url: str, broker_prefix: str,
                 request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(**settings)`` -> a :class:`Cluster` on the session's Postgres ledger and the shared
    Redis under this test's key prefix; settings become ``COMPILESVC_*`` variables."""
    with cluster_factory(tmp_path, request, database_url=pg_url, broker_url=REDIS_URL,
                         broker_key_prefix=broker_prefix) as make:
        yield make


@pytest.fixture(scope="session")
def tiny_torch_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny exported program with ``forward(input_ids, attention_mask)`` and dynamic batch/sequence."""
    import torch
    from torch import nn
    from torch.export import Dim

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.proj = nn.Linear(16, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
            return self.proj(hidden).sum(dim=1)

    torch.manual_seed(0)
    model = Tiny().eval()
    example = (torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.int64))
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=1024)
    exported = torch.export.export(model, example, dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                                   "attention_mask": {0: batch, 1: seq}})
    path = tmp_path_factory.mktemp("model") / "tiny.pt2"
    torch.export.save(exported, path)
    return path


def redis_connections_of(pid: int) -> list[str]:
    """``ip:port`` of every TCP connection process ``pid`` holds to the Redis server (as Redis sees them)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    port = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    addresses = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if inode in inodes and int(remote.split(":")[1], 16) == port:
            ip_hex, port_hex = local.split(":")
            ip = ".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            addresses.append(f"{ip}:{int(port_hex, 16)}")
    return addresses


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model as a TorchScript file: loads in milliseconds in each compile child (export.load takes ~1 s)."""
    import torch

    from tests.workers import DEMO_MODEL

    path = tmp_path_factory.mktemp("models") / "demo.pt"
    example = (torch.randint(0, 100, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(torch.export.load(str(DEMO_MODEL)).module(), example), str(path))
    return str(path)
