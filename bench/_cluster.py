"""Shared by the benches that run the whole service (not a bench itself): the production stack on throwaway state.

:func:`running_stack` starts ``compilesvc serve`` (gunicorn) and ``compilesvc relay`` on a fresh Postgres
database, Redis under a unique key prefix and a local-directory artifact store; :meth:`Stack.start_workers`
(re)starts ``compilesvc worker`` processes. Processes are started and awaited with the test suite's own
cluster (:class:`tests.workers.conftest.Cluster`: each in its own session, readiness from the JSON log
line "worker ready" / "relay started"), so run from the repository root. On leaving the ``with`` block,
also by an exception, Ctrl-C or SIGTERM/SIGHUP, every process group is killed, the database dropped and the
Redis keys under the prefix deleted.

Settings are the production defaults (lease, heartbeat, relay interval), not the tests' short ones.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import requests

from bench._proc import cpu_seconds
from bench.api_throughput import free_port
from compilesvc.config.settings import Settings
from compilesvc.ledger.migrate import upgrade
from compilesvc.services import Services
from tests.doubles import neuron_double_env
from tests.doubles.compiler_flags import DOUBLE_FLAGS_SETTING
from tests.fixtures.ledger import create_pg_database, drop_pg_database
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, bearer
from tests.workers.conftest import (
    NEURON_SDK,
    REDIS_URL,
    Cluster,
    ServiceProcess,
    _clean_environ,
    delete_redis_keys,
    wait_for,
)


def timestamp(value: str | None) -> float | None:
    """An ISO 8601 time (the API's and the JSON logs') as epoch seconds, comparable with ``time.time()``."""
    return datetime.fromisoformat(value).timestamp() if value else None


@dataclass
class Submitted:
    status: int
    body: dict[str, Any]
    sent: float  # time.time() just before the request
    answered: float  # ... and once the response was read

    @property
    def build_id(self) -> int:
        return int(self.body["build_id"])

    @property
    def latency(self) -> float:
        return self.answered - self.sent


@dataclass
class Finished:
    doc: dict[str, Any]  # GET /v1/builds/{id} once the build left "building"
    observed: float  # time.time() of the poll that saw it
    polls: int


@dataclass
class Stack:
    cluster: Cluster
    base: str
    pg_url: str
    prefix: str
    workers: list[ServiceProcess] = field(default_factory=list)
    http: requests.Session = field(default_factory=lambda: _authorized(requests.Session()))
    _started: int = 0

    @property
    def services(self) -> Services:
        return self.cluster.services

    # -- workers ----------------------------------------------------------------------------------------

    def start_workers(self, concurrency: int, env: dict[str, str] | None = None,
                      double_queue: str | None = None) -> None:
        """Stop the running workers (gracefully: they are idle), then start one ``compilesvc worker -c
        concurrency`` for this host's own (cpu) queues and, with ``double_queue``, a second one with the Neuron
        SDK double on its paths that consumes only that queue. Returns once every worker logged "worker
        ready"."""
        for worker in self.workers:
            worker.stop()
        self.workers = []
        self._started += 1
        base = ["worker", "-c", str(concurrency), "-l", "INFO"]
        name = f"cpu{self._started}-c{concurrency}"
        self.workers.append(self.cluster._start(name, [*base, "-n", f"{name}@bench"], env))
        if double_queue is not None:
            name = f"double{self._started}-c{concurrency}"
            double_env = neuron_double_env({**self.cluster.env, **(env or {})}, sdk=NEURON_SDK)
            self.workers.append(self.cluster._start(name, [*base, "-n", f"{name}@bench", "-Q", double_queue],
                                                    double_env))
        for worker in self.workers:
            worker.wait_ready(timeout=120)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by every live process of the stack's process groups (API,
        relay, workers) and by the children they waited for (compile children and the compilers they ran).
        Linux /proc only."""
        groups = {p.proc.pid for p in self.cluster.processes if p.proc.poll() is None}
        return cpu_seconds(lambda _pid, fields: int(fields[2]) in groups, with_children=True)

    def worker_records(self, msg: str) -> list[dict[str, Any]]:
        """Log records with this message from every worker started so far."""
        return [r for p in self.cluster.processes if p.name.startswith(("cpu", "double")) for r in p.logged(msg)]

    # -- HTTP -------------------------------------------------------------------------------------------

    def upload_model(self, data: bytes) -> str:
        response = self.http.post(f"{self.base}/v1/models", data=data,
                                  headers={"Content-Type": "application/octet-stream"}, timeout=60)
        if response.status_code != 201:
            raise RuntimeError(f"model upload answered {response.status_code}: {response.text[:500]}")
        return str(response.json()["uri"])

    def submit(self, spec: dict[str, Any], session: requests.Session | None = None) -> Submitted:
        sent = time.time()
        response = (session or self.http).post(f"{self.base}/v1/builds", json=spec, headers=bearer(BOOTSTRAP_TOKEN),
                                               timeout=120)
        body = response.json()
        answered = time.time()
        if response.status_code not in (200, 202):
            raise RuntimeError(f"submit answered {response.status_code}: {response.text[:500]}")
        return Submitted(response.status_code, body, sent, answered)

    def build(self, build_id: int) -> dict[str, Any]:
        response = self.http.get(f"{self.base}/v1/builds/{build_id}", timeout=30)
        response.raise_for_status()
        return dict(response.json())

    def wait_finished(self, build_id: int, *, poll: float, timeout: float) -> Finished:
        """Poll GET /v1/builds/{id} every ``poll`` seconds until the build is no longer building."""
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            doc = self.build(build_id)
            observed = time.time()
            polls += 1
            if doc["state"] != "building":
                return Finished(doc, observed, polls)
            if time.monotonic() > deadline:
                raise TimeoutError(f"build {build_id} still building after {timeout:.0f} s: "
                                   f"{[(b['state'], b['attempts']) for b in doc['buckets']]}")
            time.sleep(poll)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as Ctrl-C does), so ``finally`` blocks clean up."""
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def running_stack(*, api_workers: int = 2, api_threads: int = 8, keep: bool = False,
                  env: dict[str, str] | None = None) -> Iterator[Stack]:
    """API + relay on fresh state (see the module doc); no workers yet. ``env`` is added to every process's
    environment. With ``keep``, the work directory (logs) is left and its path printed."""
    workdir = Path(tempfile.mkdtemp(prefix="compilesvc-bench-"))
    prefix = f"compilesvc-bench-{os.getpid()}-{uuid.uuid4().hex[:10]}:"
    pg_url: str | None = None
    cluster: Cluster | None = None
    with interrupt_on_signals():
        try:
            pg_url = create_pg_database("compilesvc_bench")
            upgrade(pg_url)
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            values: dict[str, Any] = {
                "data_dir": str(workdir / "data"),
                "database_url": pg_url,
                "store_url": (workdir / "store").as_uri(),
                "broker_url": REDIS_URL,
                "broker_key_prefix": prefix,
                "secret_key": f"bench-{uuid.uuid4().hex}",
                "bootstrap_token": BOOTSTRAP_TOKEN,
                "public_url": base,
                # the API accepts the Neuron test double's --double-behaviour (bench.pipeline b. and d.)
                "extra_compiler_flags": DOUBLE_FLAGS_SETTING,
            }
            metrics = workdir / "metrics"  # gunicorn's multiprocess metrics, removed with the work directory
            metrics.mkdir()
            process_env = {**_clean_environ(), **(env or {}), "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
            process_env.update({f"COMPILESVC_{k.upper()}": str(v) for k, v in values.items()})
            services = Services.from_settings(Settings(**values))
            cluster = Cluster(tmp=workdir, env=process_env, settings=services.settings, services=services)
            stack = Stack(cluster=cluster, base=base, pg_url=pg_url, prefix=prefix)
            cluster._start("api", ["serve", "--host", "127.0.0.1", "--port", str(port), "--workers",
                                   str(api_workers), "--threads", str(api_threads)], None)
            wait_for(lambda: _ok(stack.http, f"{base}/readyz"), 60, "the API to be ready")
            cluster.start_relay()
            yield stack
        finally:
            if cluster is not None:
                with suppress(Exception):
                    cluster.kill_all()
                with suppress(Exception):
                    cluster.services.close()
            if pg_url is not None:
                drop_pg_database(pg_url)
            delete_redis_keys(prefix)
            if keep:
                print(f"work directory kept: {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def _authorized(session: requests.Session) -> requests.Session:
    session.headers.update(bearer(BOOTSTRAP_TOKEN))
    return session


def _ok(http: requests.Session, url: str) -> bool:
    try:
        return http.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False
