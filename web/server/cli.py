"""``compilesvc serve``: the API and UI under gunicorn (or Werkzeug's server with ``--dev``).

Registered under the ``compilesvc.commands`` entry-point group, so the core CLI never imports the web
layer. Gunicorn runs programmatically (``BaseApplication``) with threaded workers: live log streams hold a
thread for their (bounded) lifetime, and a sync worker would be blocked, then killed, by one. The worker
class is :class:`web.server.httpworker.ProblemThreadWorker` (gthread that reads request heads off-thread, bounds
every socket wait and answers its own errors as problem+json); what that does and does not protect against
without the reverse proxy is in docs/deploy.md, "Slow clients".

With more than one worker, Prometheus counters are kept in a multiprocess directory so that a scrape
sees the sum over workers; ``PROMETHEUS_MULTIPROC_DIR`` must be set before prometheus_client is first
imported, which is why this module imports neither it nor the app at import time.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from compilesvc import jsonlog


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _prepare_multiprocess_metrics(workers: int) -> None:
    """Give gunicorn's workers a shared, empty directory for their metric files."""
    if workers < 2:
        return
    if "prometheus_client" in sys.modules:
        click.echo("warning: prometheus_client was imported before serve set up multiprocess metrics; "
                   "counters will be per worker", err=True)
        return
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        # Files of a previous run would be summed into this one's counters.
        for stale in Path(directory).glob("*.db"):
            stale.unlink(missing_ok=True)
    else:
        directory = tempfile.mkdtemp(prefix="compilesvc-metrics-")
        atexit.register(shutil.rmtree, directory, True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def _child_exit(_server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


#: Settings only some supported gunicorn versions have.
OPTIONAL_SETTINGS = frozenset({"control_socket_disable"})


def run_gunicorn(app_factory: Callable[[], Any], options: dict[str, Any]) -> None:
    """Serve the WSGI app ``app_factory()`` with gunicorn and ``options`` (gunicorn setting names)."""
    from gunicorn.app.base import BaseApplication

    class Server(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for name, value in options.items():
                if name in OPTIONAL_SETTINGS and name not in self.cfg.settings:
                    continue  # a setting newer than the installed gunicorn
                self.cfg.set(name, value)

        def load(self) -> Any:
            return app_factory()

    Server().run()


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 128), help="Worker processes.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1, 512),
              help="Threads per worker; each live log stream holds one.")
@click.option("--timeout", default=60, show_default=True, type=click.IntRange(1),
              help="Seconds a worker may be silent before it is restarted.")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(0.5, 600),
              help="Seconds a client may take to send a whole request head (then 408).")
@click.option("--io-timeout", default=60.0, show_default=True, type=click.FloatRange(1, 3600),
              help="Seconds one socket read or write of a request being served may wait (then the "
                   "request is abandoned).")
@click.option("--forwarded-allow-ips", default=None, metavar="IPS",
              help="Comma-separated addresses or networks (or '*') of the reverse proxy, whose "
                   "X-Forwarded-For/-Proto are believed. Default: $FORWARDED_ALLOW_IPS, else 127.0.0.1,::1.")
@click.option("--reuse-port/--shared-socket", "reuse_port", default=False, show_default=True,
              help="Each worker listens on a socket of its own (SO_REUSEPORT), and the kernel hashes new "
                   "connections over them; or all share one socket, taken from by whichever worker is "
                   "free. docs/deploy.md.")
@click.option("--dev", is_flag=True, help="Werkzeug's development server instead of gunicorn (one process).")
@click.option("--migrate", "run_migrations", is_flag=True, help="Upgrade the ledger schema before serving.")
def serve(host: str, port: int, workers: int, threads: int, timeout: int, header_timeout: float,
          io_timeout: float, forwarded_allow_ips: str | None, reuse_port: bool, dev: bool,
          run_migrations: bool) -> None:
    """Serve the HTTP API and web UI."""
    if reuse_port and port == 0:
        raise click.UsageError("--reuse-port needs a fixed --port: each worker would pick a port of its own")
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise click.UsageError("--reuse-port needs SO_REUSEPORT, which this platform does not have")
    from pydantic import ValidationError

    from compilesvc.config.settings import Settings

    level = jsonlog.level_from_env()
    jsonlog.configure(level, service="api")
    try:
        settings = Settings()
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise click.UsageError(f"invalid COMPILESVC_* settings: {errors}") from None
    if run_migrations:
        from compilesvc.ledger.migrate import upgrade

        url = settings.resolved_database_url
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        try:
            upgrade(url)
        except Exception as exc:
            raise click.ClickException(f"migration failed: {type(exc).__name__}: {exc}") from None

    # Live log streams may take at most half of a worker's threads; the rest keep serving the API.
    config = {"SSE_MAX_STREAMS": max(1, threads // 2)}
    if dev:
        from web.server.app import create_app

        create_app(settings, config=config).run(host=host, port=port, threaded=True, use_reloader=False,
                                                debug=False)
        return

    _prepare_multiprocess_metrics(workers)
    from web.server import httpworker

    # Set before gunicorn forks: every worker inherits it.
    httpworker.ProblemThreadWorker.limits = httpworker.ClientLimits(header_timeout, io_timeout)
    trusted = forwarded_allow_ips or os.environ.get("FORWARDED_ALLOW_IPS") or "127.0.0.1,::1"

    def factory() -> Any:
        from web.server.app import create_app
        from web.server.proxied import TrustedProxy

        # In each worker, after the fork: its own engine and pools.
        return TrustedProxy(create_app(settings, config=config), trusted)

    run_gunicorn(factory, {
        "bind": _bind(host, port),
        "workers": workers,
        # With SO_REUSEPORT each worker binds its own socket and the kernel hashes connections over them;
        # on one shared socket (the default) whichever worker waits in accept takes the next one. Not the
        # default: a worker that dies drops the connections still queued on its socket (unless
        # net.ipv4.tcp_migrate_req is set), and it measured no better than the shared socket once a worker
        # no longer stalls on closing connections (web/server/httpworker.py; docs/deploy.md).
        "reuse_port": reuse_port,
        "worker_class": "web.server.httpworker.ProblemThreadWorker",
        "threads": threads,
        "timeout": timeout,
        "graceful_timeout": 30,
        # Idle kept-alive connections wait in the event loop, not in a thread. Above the reverse proxy's
        # upstream keepalive_timeout (4 s), so the proxy never reuses a connection gunicorn is closing.
        "keepalive": 5,
        # Request heads: artifact keys and build ids are short; these are gunicorn's ceilings and match
        # the proxy's large_client_header_buffers (8 KiB per line), so both refuse the same requests.
        "limit_request_line": 8190,
        "limit_request_fields": 64,
        "limit_request_field_size": 8190,
        # Whose X-Forwarded-Proto sets wsgi.url_scheme (and, in TrustedProxy, whose X-Forwarded-For is
        # the client address). No path or SCRIPT_NAME from headers: the API is served at the root.
        "forwarded_allow_ips": trusted,
        "forwarder_headers": "",
        "preload_app": False,
        "logconfig_dict": jsonlog.gunicorn_logconfig(level, service="api"),
        "accesslog": None,
        "logger_class": "web.server.httpworker.AppLogsRequests",
        "child_exit": _child_exit,
        "proc_name": "compilesvc-api",
        # gunicorn 24+ opens a control socket at one fixed per-user path: two servers on a host (tests,
        # benchmarks, several instances) would fight over it, and nothing here uses it.
        "control_socket_disable": True,
    })
