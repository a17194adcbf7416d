"""The soak's service: compilesvc laid out as compose lays it out, on throwaway state, for the soak test and
``bench.soak`` alike (no pytest fixture: the bench runs outside pytest).

:func:`soak_stack` starts, in order: ``weed mini`` (the S3 artifact store), a fresh database on the shared
Postgres (migrated), ``compilesvc serve`` (gunicorn, 2 processes), ``compilesvc relay``, two ``compilesvc
worker`` processes (thread pool) on the shared Redis under a key prefix of its own, and a real nginx running
compose's proxy configuration (``tests/fixtures/nginx.py``) in front of the API. Compiles use the Neuron
test double's ``neuronx-cc`` path (a fresh process per compile, but no torch: a fraction of a second).

The soak breaks nothing, so it needs no private Postgres or Redis: a database and a key prefix of its own are
enough, and lighter on a 2-core host. Settings are production's except three: the double's compiler flag is
declared (``extra_compiler_flags``), the per-token submit rate is raised (a soak client submits several times
a second; the limiter has tests of its own and would only turn the load into 429s), and the token cache is
shortened so the soak also exercises the ledger's token checks, not only the cache.

On leaving the block, also by an exception or Ctrl-C, every process group is killed by its pid, the database
dropped and the Redis keys deleted. ``keep`` leaves the work directory (every process's log).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.ledger.migrate import upgrade
from compilesvc.services import Services
from tests.doubles import neuron_double_env
from tests.doubles.compiler_flags import DOUBLE_FLAGS_SETTING
from tests.fixtures.ledger import create_pg_database, drop_pg_database
from tests.fixtures.nginx import Proxy, nginx_proxy
from tests.fixtures.ports import free_port
from tests.fixtures.s3server import WeedProcess
from tests.fixtures.tokens import BOOTSTRAP_TOKEN, make_token
from tests.workers.conftest import NEURON_SDK, REDIS_URL, Cluster, ServiceProcess, _clean_environ, delete_redis_keys

#: The settings the soak changes from production's defaults (see the module docstring for why).
SOAK_SETTINGS: dict[str, Any] = {
    "extra_compiler_flags": DOUBLE_FLAGS_SETTING,
    "submit_rate_limit": "100/second",
    "token_cache_seconds": 2,
}


@dataclass
class SoakStack:
    """The running service: ``base`` is nginx's address (every client request goes there)."""

    cluster: Cluster
    proxy: Proxy
    api: ServiceProcess
    relay: ServiceProcess
    workers: list[ServiceProcess]
    workdir: Path
    pg_url: str
    model_uri: str = ""
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.proxy.base

    def nginx_pid(self) -> int:
        return int((self.proxy.prefix / "nginx.pid").read_text().strip())

    def make_tokens(self, clients: int) -> list[str]:
        """One submit-scoped token per client (as CI jobs of several teams have), made in the ledger."""
        engine = make_engine(self.pg_url)
        try:
            sessions = make_sessionmaker(engine)
            return [make_token(sessions, "submit", owner=f"soak-{i}", team=f"team-{i % 3}", name=f"soak client {i}")
                    for i in range(clients)]
        finally:
            engine.dispose()

    def logs(self) -> dict[str, Path]:
        """Each process's log, for a failure's post-mortem."""
        found = {p.name: p.log_path for p in self.cluster.processes}
        found["nginx"] = self.proxy.prefix / "error.log"
        found["weed"] = self.workdir / "weed" / "weed.log"
        return found


@contextlib.contextmanager
def soak_stack(workdir: Path | None = None, *, api_workers: int = 2, workers: int = 2, concurrency: int = 2,
               keep: bool = False) -> Iterator[SoakStack]:
    """The stack of the module docstring; yields once nginx answers and every worker consumes."""
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="compilesvc-soak-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    prefix = f"compilesvc-soak-{os.getpid()}-{uuid.uuid4().hex[:10]}:"
    weed = WeedProcess(workdir / "weed")
    pg_url: str | None = None
    cluster: Cluster | None = None
    try:
        s3 = weed.start()
        bucket = s3.new_bucket("soak")
        pg_url = create_pg_database("compilesvc_soak")
        upgrade(pg_url)
        api_port, proxy_port = free_port(), free_port()
        values: dict[str, Any] = {
            "data_dir": str(workdir / "data"),
            "database_url": pg_url,
            "store_url": f"s3://{bucket}/artifacts",
            "s3_endpoint_url": s3.endpoint_url,
            "broker_url": REDIS_URL,
            "broker_key_prefix": prefix,
            "secret_key": f"soak-{uuid.uuid4().hex}",
            "bootstrap_token": BOOTSTRAP_TOKEN,
            "public_url": f"http://127.0.0.1:{proxy_port}",
            **SOAK_SETTINGS,
        }
        env = neuron_double_env(_clean_environ(), sdk=NEURON_SDK)
        env.update({f"COMPILESVC_{k.upper()}": str(v) for k, v in values.items()})
        env.update(s3.env())
        # Nothing in this process uses the store: a Services without one (the S3 credentials live in the
        # subprocesses' environment only) is enough for the Cluster's bookkeeping.
        local = {**values, "store_url": (workdir / "unused-store").as_uri(), "s3_endpoint_url": None}
        cluster = Cluster(tmp=workdir, env=env, settings=Settings(**local),
                          services=Services.from_settings(Settings(**local)))
        api = cluster.start_api(api_port, workers=api_workers)
        relay = cluster.start_relay()
        started = [cluster.start_worker(f"w{i + 1}", concurrency=concurrency, wait=False) for i in range(workers)]
        for worker in started:
            worker.wait_ready(timeout=120)
        with nginx_proxy(workdir / "nginx", proxy_port, f"127.0.0.1:{api_port}") as proxy:
            yield SoakStack(cluster=cluster, proxy=proxy, api=api, relay=relay, workers=started, workdir=workdir,
                            pg_url=pg_url)
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.kill_all()
            with contextlib.suppress(Exception):
                cluster.services.close()
        weed.kill()
        if pg_url is not None:
            drop_pg_database(pg_url)
        delete_redis_keys(prefix)
        if keep:
            print(f"work directory kept: {workdir}")
        elif own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
