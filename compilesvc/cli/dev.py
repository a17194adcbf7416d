"""``compilesvc dev``: the whole service on one machine with no external services.

It migrates a SQLite ledger, then runs the API, one worker and the relay/reaper as child processes
sharing one data directory (SQLite ledger, local artifact directory, kombu filesystem broker). On its first
start it makes an admin token, keeps it in ``<data dir>/admin-token`` (mode 0600, like the generated
secret key beside it) and prints it at every start; it also generates the key that signs what it publishes
(``signing-key.pem``, 0600, with ``signing-key.pub.pem`` beside it) and prints how a fleet trusts it, so
the UI and the CLI can be used at once. With
``--demo`` it uploads the bundled tiny model through the API, submits its three-bucket spec, follows the
build to the end and prints where to look. Once its worker has registered it says, in one line, what it compiles
for: the cpu, and the Neuron targets of ``COMPILESVC_NEURON_SDK``'s release when it was started in that SDK's
environment, which the worker inherits (an LLM compile needs that; docs/llm.md, "Trying it locally"). The
launcher talks to the children only over HTTP and the process table, so the core never imports the web or worker code.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from compilesvc.access import tokens
from compilesvc.client.api import Api, ApiError
from compilesvc.config.settings import Settings
from compilesvc.demo import demo_model_bytes, demo_spec
from compilesvc.ledger.engine import make_engine, make_sessionmaker, transaction
from compilesvc.ledger.migrate import upgrade
from compilesvc.services import publishing_key
from compilesvc.signing.keys import GENERATED_KEY_NAME, TRUSTED_KEYS_ENV, KeyFileError, public_key_path
from compilesvc.states import BuildState


class DevError(click.ClickException):
    """A one-line failure of the launcher (exit code 1)."""


@dataclass
class Children:
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "compilesvc", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def check(self, log_dir: Path) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-5:]
                raise DevError(f"the {name} process exited with {proc.returncode}: " + " | ".join(tail))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_until(what: str, check: Any, children: Children, log_dir: Path, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children.check(log_dir)
        try:
            result = check()
        except ApiError:  # not up yet, or not ready: ask again
            result = None
        if result:
            return result
        time.sleep(0.3)
    raise DevError(f"timed out after {timeout:.0f} s waiting for {what}; logs are in {log_dir}")


ADMIN_TOKEN_FILE = "admin-token"


def admin_token(settings: Settings) -> tuple[str, bool]:
    """The embedded service's admin token (made on first start, kept in the data dir) and whether it is new.
    A kept token that no longer works (revoked, expired, another ledger) is replaced."""
    path = settings.data_dir / ADMIN_TOKEN_FILE
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    try:
        if path.is_file():
            secret = path.read_text().strip()
            with sessions() as session:
                if tokens.authenticate(session, secret) is not None:
                    return secret, False
        with transaction(sessions) as session:
            secret = tokens.create_token(session, name="compilesvc dev", owner="dev", scopes=["admin"],
                                         created_by="compilesvc dev").secret
    finally:
        engine.dispose()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return secret, True


def signing_key_note(settings: Settings) -> str:
    """Make the signing key now, before the children race for it, and say how a fleet trusts it."""
    if settings.publish_unsigned:
        return "artifacts are published unsigned (COMPILESVC_PUBLISH_UNSIGNED): fleets refuse them"
    try:
        key = publishing_key(settings)
    except KeyFileError as exc:
        raise DevError(str(exc)) from None
    assert key is not None
    public = public_key_path(settings.signing_key_file or settings.data_dir / GENERATED_KEY_NAME)
    if not public.exists():
        return f"artifacts are signed by key {key.key_id}; give fleets its public key (docs/fleet.md)"
    return (f"artifacts are signed by key {key.key_id}; fleets trust it with: "
            f"export {TRUSTED_KEYS_ENV}={public}")


#: Held (flock) by the ``compilesvc dev`` that runs on a data directory, for as long as it runs.
LOCK_FILE = "dev.lock"


def hold_data_dir(data_dir: Path) -> int:
    """Refuse to be a second ``dev`` on ``data_dir``: its demo would be answered by the first one's API and
    its children would fight over the ledger and the port. The lock dies with this process."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DevError(f"another compilesvc dev (pid {holder}) runs on {data_dir}: stop it (Ctrl-C), or give this "
                       "one another --data-dir and --port") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd  # the lock lasts as long as this descriptor is open


def check_port_free(port: int) -> None:
    """The API's port, tried before anything starts: taken, the API child would die on "Address already in
    use" after the other processes started."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds: TIME_WAIT is no owner
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise DevError(f"port {port} on 127.0.0.1 is in use ({exc.strerror}): stop what listens there, or "
                           "pass another --port") from None


def run_demo(base: str, children: Children, log_dir: Path, token: str) -> dict[str, Any]:
    """Upload the bundled model, submit its spec and wait for the build; returns the finished build."""
    spec = demo_spec()
    started = time.monotonic()
    api = Api(base, token=token)
    uploaded = api.request("POST", "/v1/models", upload=demo_model_bytes())
    spec["model"]["uri"] = uploaded["uri"]
    polling = Api(base, retries=0, token=token)
    workers = _wait_until("a worker to register", lambda: polling.request("GET", "/v1/workers").get("workers"),
                          children, log_dir, 120)
    # The cpu target's "sdk" is the torch release: build with the one the worker actually has.
    cpu_sdks = sorted({w["capabilities"]["sdk"]["cpu"] for w in workers if "cpu" in w["capabilities"].get("sdk", {})})
    if not cpu_sdks:
        raise DevError(f"the worker cannot compile for the cpu target (is torch installed?); see {log_dir}")
    spec["sdk"] = cpu_sdks[0]
    submitted = api.request("POST", "/v1/builds", spec, {"Idempotency-Key": str(uuid.uuid4())})
    build_id = submitted["build_id"]
    click.echo(f"demo build {build_id} ({submitted['outcome']}): {base}/builds/{build_id}")
    click.echo(f"  log: {submitted['logs_url']}")

    def finished() -> dict[str, Any] | None:
        build: dict[str, Any] = polling.request("GET", f"/v1/builds/{build_id}")
        return build if build["state"] != BuildState.BUILDING else None

    build = _wait_until(f"demo build {build_id}", finished, children, log_dir, 600)
    elapsed = time.monotonic() - started
    click.echo(f"demo build {build_id} {build['state']} in {elapsed:.1f} s; artifact "
               f"{base}/v1/artifacts/{build['artifact_key']}")
    if build["state"] != BuildState.SUCCEEDED:
        raise DevError(f"the demo build ended {build['state']}; see {base}/builds/{build_id}")
    return dict(build)


def worker_summary(workers: list[dict[str, Any]], neuron_sdk: str | None = None) -> str | None:
    """What the registered workers compile, in one line (None: none registered yet). A Neuron compile (an LLM's
    above all) needs a worker started in the Neuron SDK's environment with ``COMPILESVC_NEURON_SDK``; without one
    the first submit would be the first to say so (a 503), so the launcher says it at start. ``neuron_sdk``: the
    ``COMPILESVC_NEURON_SDK`` dev was started with, when set (then the SDK is what is missing, not the setting)."""
    if not workers:
        return None
    by_sdk: dict[str, list[str]] = {}
    kinds: dict[str, set[str]] = {}
    cpu: set[str] = set()
    for worker in workers:
        caps = worker.get("capabilities") or {}
        for target, sdk in (caps.get("sdk") or {}).items():
            if target == "cpu":
                cpu.add(str(sdk))
            else:
                by_sdk.setdefault(str(sdk), []).append(target)
                kinds.setdefault(str(sdk), set()).update((caps.get("neuron") or {}).get("kinds") or [])
    parts = [f"cpu (torch {', '.join(sorted(cpu))})"] if cpu else []
    parts += [f"{', '.join(sorted(set(targets)))} (Neuron SDK {sdk}: {', '.join(sorted(kinds[sdk]))})"
              for sdk, targets in sorted(by_sdk.items())]
    line = "worker compiles for: " + ("; ".join(parts) or "nothing")
    if not by_sdk and neuron_sdk:
        line += (f"; no Neuron target: COMPILESVC_NEURON_SDK is {neuron_sdk}, but the worker found no Neuron SDK of "
                 "that release in its environment: start dev inside the SDK's virtualenv (`compilesvc doctor` says "
                 "what is missing; docs/llm.md, 'Trying it locally')")
    elif not by_sdk:
        line += ("; no Neuron target: start dev in the Neuron SDK's environment with COMPILESVC_NEURON_SDK set "
                 "(docs/llm.md, 'Trying it locally')")
    return line


@click.command("dev")
@click.option("--demo", is_flag=True, help="Upload the bundled tiny model and build it.")
@click.option("--port", default=8080, show_default=True)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Where the ledger, artifacts and broker live (default: $COMPILESVC_DATA_DIR or .compilesvc).")
@click.option("--exit-after-demo", is_flag=True, help="Stop once the demo build finished (for scripts).")
def dev(demo: bool, port: int, data_dir: Path | None, exit_after_demo: bool) -> None:
    """Run API, worker and relay on this machine: SQLite, local artifacts, filesystem broker."""
    data_dir = (data_dir or Settings().data_dir).resolve()
    log_dir = data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_data_dir(data_dir)
    try:
        check_port_free(port)
        _run(demo, port, data_dir, log_dir, exit_after_demo)
    finally:
        os.close(lock)


def _run(demo: bool, port: int, data_dir: Path, log_dir: Path, exit_after_demo: bool) -> None:
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "COMPILESVC_DATA_DIR": str(data_dir), "COMPILESVC_PUBLIC_URL": base,
           "COMPILESVC_HEARTBEAT_SECONDS": os.environ.get("COMPILESVC_HEARTBEAT_SECONDS", "2")}
    settings = Settings(data_dir=data_dir)
    for name in ("database_url", "store_url", "broker_url"):
        if getattr(settings, name):
            click.echo(f"note: {name} is set in the environment; dev uses it instead of the embedded default")
    upgrade(settings.resolved_database_url)
    token, new = admin_token(settings)
    trust = signing_key_note(settings)

    children = Children()
    stop = False

    def _stop(signum: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        children.start("api", ["serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"], env, log_dir)
        children.start("worker", ["worker", "--concurrency", "2"], env, log_dir)
        children.start("relay", ["relay"], env, log_dir)
        _wait_until("the API", lambda: Api(base, retries=0).request("GET", "/healthz"), children, log_dir, 60)
        click.echo(f"compilesvc is up: {base}  (data in {data_dir}, logs in {log_dir})")
        token_file = data_dir / ADMIN_TOKEN_FILE
        click.echo(f"admin token{' (new)' if new else ''}: {token}")
        click.echo(f"  UI: {base}/login (paste the token); CLI: export COMPILESVC_TOKEN=$(cat {token_file})")
        click.echo(trust)
        if demo:
            run_demo(base, children, log_dir, token)
            if exit_after_demo:
                return
        click.echo("Ctrl-C stops it.")
        said, polling = False, Api(base, retries=0, token=token)
        while not stop:
            children.check(log_dir)
            if not said:  # once, when the worker has registered: what it serves
                try:
                    summary = worker_summary(polling.request("GET", "/v1/workers").get("workers") or [],
                                             os.environ.get("COMPILESVC_NEURON_SDK", "").strip() or None)
                except ApiError:
                    summary = None
                if summary:
                    click.echo(summary)
                    said = True
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        children.stop()
