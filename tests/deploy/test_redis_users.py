"""The compose stack's Redis users (docker/redis/users.sh), proved against a real redis-server that the test
starts through docker/redis/start.sh, the redis container's own entry script, so it serves exactly the ACL
file that script writes.

Each service does with the real code what it does in production, and Redis refuses none of it (its ACL LOG
stays empty): the API and the relay publish a compile task through Celery as the outbox does; the API counts
submits with the rate limiter; a worker's Celery connection receives (BRPOP), acknowledges, requeues (a
``Reject(requeue=True)``), has kombu's visibility-timeout restore hand a message back, and returns what it
holds when it stops; the relay's reconciler reads the queues and the unacked hash. And nothing more: the API
cannot consume, read or delete a queue, the worker cannot FLUSHALL, CONFIG SET or read keys outside its own,
no service user can run ACL or CONFIG, and the ``default`` user cannot log in.

A whole compile with a worker, a relay and an API process on these users: tests/workers/test_least_privilege_e2e.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Exchange, Queue

from compilesvc.access.tokens import Principal, Scope
from compilesvc.compiles.reconcile import RedisView
from compilesvc.config.settings import Settings
from compilesvc.dispatch.routing import COMPILE_TASK, make_producer, task_id
from tests.fixtures.private_services import PrivateRedis
from web.contract.problems import Problem
from web.server.ratelimit import SubmitLimiter
from workers.celery_app import make_app

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "docker" / "redis"
PASSWORDS = {"admin": "admin-pw-0123456789", "api": "api-pw-0123456789", "relay": "relay-pw-0123456789",
             "worker": "worker-pw-0123456789"}
VARIABLES = {"admin": "REDIS_PASSWORD", "api": "REDIS_API_PASSWORD", "relay": "REDIS_RELAY_PASSWORD",
             "worker": "REDIS_WORKER_PASSWORD"}
SERVICE_USERS = ("api", "relay", "worker")


def script_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **{VARIABLES[user]: password for user, password in PASSWORDS.items()}, **extra}


def write_acl(path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = script_env(REDIS_HEALTHCHECK_PASSWORD="health-pw-0123456789", **extra)
    return subprocess.run(["sh", str(SCRIPTS / "users.sh"), str(path)], env=env, capture_output=True, text=True,
                          timeout=30)


def acl_redis(workdir: Path) -> PrivateRedis:
    """redis-server on a free port (not started yet), started by start.sh as the container starts it, so
    with the users users.sh makes from :data:`PASSWORDS`; its :meth:`~PrivateRedis.client` is the admin's."""
    env = script_env(REDIS_ENTRYPOINT="redis-server", REDIS_CONFIG_DIR=str(workdir / "config"))
    return PrivateRedis(workdir, launcher=["sh", str(SCRIPTS / "start.sh")], env=env,
                        admin=("admin", PASSWORDS["admin"]))


def broker_url(server: PrivateRedis, user: str) -> str:
    return server.url_as(user, PASSWORDS[user])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = acl_redis(tmp_path_factory.mktemp("redis-users")).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def admin(server: PrivateRedis) -> Iterator[redis.Redis]:
    """The admin's client; the ACL log starts empty."""
    client = server.client()
    client.acl_log_reset()
    yield client
    client.close()


@pytest.fixture
def queue() -> str:
    """A compile queue of this test's own (compile.*, as dispatch.queue_name names them)."""
    return f"compile.cpu.2.13.0.test-{uuid.uuid4().hex[:8]}"


def as_user(server: PrivateRedis, user: str) -> redis.Redis:
    return redis.Redis.from_url(broker_url(server, user), socket_timeout=5, socket_connect_timeout=5)


def settings(server: PrivateRedis, user: str, tmp_path: Path, **overrides: Any) -> Settings:
    return Settings(data_dir=tmp_path, broker_url=broker_url(server, user), **overrides)


def publish(settings: Settings, queue: str, bucket_id: int) -> None:
    """As the outbox relays a committed row (compilesvc/dispatch/outbox.py), in the API and in the relay."""
    producer = make_producer(settings)
    try:
        kwargs = {"bucket_compile_id": bucket_id, "target": "cpu", "sdk": "2.13.0", "backend": "torchscript",
                  "isa": None, "queue": queue}
        producer.send_task(COMPILE_TASK, kwargs=kwargs, task_id=task_id(bucket_id, 1))
    finally:
        producer.close()


def denials(admin: redis.Redis) -> list[dict[str, Any]]:
    """What Redis refused since the log was reset. redis-py names itself on connecting (CLIENT SETINFO, on
    Redis >= 7.2), is refused and ignores that: not counted."""
    return [entry for entry in admin.acl_log(count=1000) if entry.get("object") != "client|setinfo"]


@contextlib.contextmanager
def consuming(app: Celery, queue: str) -> Iterator[tuple[Connection, Callable[[], Any]]]:
    """A worker's Celery connection consuming ``queue`` as the worker's event loop does (BRPOP, prefetch 1),
    and a ``receive()`` of the next message. Leaving releases the connection as a stopping worker does."""
    received: list[Any] = []
    connection = app.connection_for_read()
    try:
        consumer = Consumer(connection.default_channel, [Queue(queue, Exchange(queue), routing_key=queue)],
                            accept=["json"], prefetch_count=1, on_message=received.append)
        consumer.consume()

        def receive() -> Any:
            received.clear()
            connection.drain_events(timeout=10)
            assert len(received) == 1
            return received[0]

        yield connection, receive
    finally:
        connection.release()


def test_each_service_does_what_it_does(server: PrivateRedis, admin: redis.Redis, queue: str,
                                        tmp_path: Path) -> None:
    # The API and the relay publish (declaring the queue as they do).
    publish(settings(server, "api", tmp_path), queue, 101)
    publish(settings(server, "relay", tmp_path), queue, 102)
    assert admin.llen(queue) == 2
    # The relay's reconciler sees both, waiting in the queue.
    relay_producer = make_producer(settings(server, "relay", tmp_path))
    view = RedisView(relay_producer)
    try:
        assert view.held_bucket_ids({queue}) == {101, 102}
        app = make_app(settings(server, "worker", tmp_path))  # a worker's own Celery app
        with consuming(app, queue) as (_, receive):
            first = receive()
            # Delivered, not acknowledged: in kombu's unacked hash, where the reconciler still sees it.
            assert admin.hlen("unacked") == 1 and admin.zcard("unacked_index") == 1 and admin.llen(queue) == 1
            assert view.held_bucket_ids({queue}) == {101, 102}
            first.ack()
            assert admin.hlen("unacked") == 0 and admin.zcard("unacked_index") == 0
            assert view.held_bucket_ids({queue}) == {102}

            second = receive()
            assert second.headers["id"] == task_id(102, 1)
            second.reject(requeue=True)  # what a worker's Reject(requeue=True) does (workers/tasks.py)
            assert admin.llen(queue) == 1 and admin.hlen("unacked") == 0

            receive()  # taken again, then the worker stops: kombu hands back what it holds
        assert admin.llen(queue) == 1 and admin.hlen("unacked") == 0

        with consuming(app, queue) as (connection, receive):
            held = receive()
            assert held.headers["id"] == task_id(102, 1) and admin.llen(queue) == 0
            # Its visibility timeout passes (delivered long ago): the workers' periodic restore hands it back.
            admin.zadd("unacked_index", {held.delivery_tag: 1.0}, xx=True)
            connection.transport.cycle.maybe_restore_messages()
            assert admin.llen(queue) == 1 and admin.hlen("unacked") == 0 and not admin.exists("unacked_mutex")
        assert view.held_bucket_ids({queue}) == {102}
    finally:
        relay_producer.close()
    assert admin.llen(queue) == 1
    assert denials(admin) == []


def test_the_api_counts_submits(server: PrivateRedis, admin: redis.Redis, tmp_path: Path) -> None:
    limiter = SubmitLimiter(settings(server, "api", tmp_path, submit_rate_limit="2/minute"))
    principal = Principal(token_id=int(uuid.uuid4().int % 10**9), name="ci", owner="ci", team="t",
                          scopes=frozenset({Scope.SUBMIT}), expires_at=datetime.now(UTC) + timedelta(hours=1))
    limiter.check(principal)
    limiter.check(principal)
    # The third is refused: the count is in Redis (a limiter whose store refused it would let it through).
    with pytest.raises(Problem) as refused:
        limiter.check(principal)
    assert refused.value.status == 429
    assert admin.keys("compilesvc-limits:*")
    assert denials(admin) == []


#: What each user tries and Redis must refuse (NOPERM), ``{queue}`` being a compile queue holding a message.
FORBIDDEN: dict[str, list[tuple[str, ...]]] = {
    "api": [("BRPOP", "{queue}", "1"), ("RPOP", "{queue}"), ("LRANGE", "{queue}", "0", "-1"), ("DEL", "{queue}"),
            ("LTRIM", "{queue}", "1", "0"), ("HGETALL", "unacked"), ("HSET", "unacked", "x", "y"),
            ("GET", "unacked_mutex"), ("SMEMBERS", "_kombu.binding.{queue}"), ("LPUSH", "other", "x")],
    "relay": [("BRPOP", "{queue}", "1"), ("RPOP", "{queue}"), ("DEL", "{queue}"), ("HSET", "unacked", "x", "y"),
              ("HDEL", "unacked", "x"), ("ZADD", "unacked_index", "1", "x"), ("GET", "compilesvc-limits:x")],
    "worker": [("DEL", "{queue}"), ("LTRIM", "{queue}", "1", "0"), ("LRANGE", "{queue}", "0", "-1"),
               ("HGETALL", "unacked"), ("DEL", "unacked"), ("GET", "compilesvc-limits:x"),
               ("SET", "compilesvc-limits:x", "0"), ("GET", "other"), ("SET", "other", "x"),
               ("EVAL", "return 1", "0"), ("PUBLISH", "/0.celery.pidbox", "x"), ("SUBSCRIBE", "/0.celery.pidbox")],
}
#: ... and what none of the service users may run at all.
EVERYBODY_FORBIDDEN: list[tuple[str, ...]] = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"), ("CONFIG", "GET", "*"),
    ("ACL", "LIST"), ("ACL", "SETUSER", "{user}", "+@all", "~*"), ("ACL", "WHOAMI"), ("KEYS", "*"), ("SCAN", "0"),
    ("SHUTDOWN", "NOSAVE"), ("SAVE",), ("BGREWRITEAOF",),
    ("MONITOR",), ("CLIENT", "KILL", "TYPE", "normal"), ("SWAPDB", "0", "1"), ("SELECT", "1"),
    ("FUNCTION", "FLUSH"), ("SCRIPT", "FLUSH"), ("RENAME", "{queue}", "stolen"), ("MIGRATE", "h", "1", "k", "0", "1"),
]
#: Refused before the ACL is asked (redis-server's enable-debug-command/enable-module-command default "no"): the
#: ACL's own answer comes from ACL DRYRUN.
PROTECTED: list[tuple[str, ...]] = [("DEBUG", "SLEEP", "0"), ("MODULE", "LOAD", "/tmp/x.so")]


@pytest.mark.parametrize("user", SERVICE_USERS)
def test_and_nothing_more(server: PrivateRedis, admin: redis.Redis, queue: str, user: str, tmp_path: Path) -> None:
    publish(settings(server, "api", tmp_path), queue, 201)
    admin.set("other", "untouched")
    client = as_user(server, user)
    try:
        for command in FORBIDDEN.get(user, []) + EVERYBODY_FORBIDDEN:
            args = [arg.format(queue=queue, user=user) for arg in command]
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*args)
    finally:
        client.close()
    for command in PROTECTED:
        assert "no permissions" in admin.execute_command("ACL", "DRYRUN", user, *command).decode()
    # Nothing happened: the message, the other key and the users are as they were.
    assert admin.llen(queue) == 1 and admin.get("other") == b"untouched"
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert "+@all" not in " ".join(map(str, admin.acl_getuser(user)["commands"]))
    logged = {entry["object"] for entry in denials(admin)}
    assert {"flushall", "config|set", "acl|setuser", "keys"} <= logged, logged


def test_the_default_user_cannot_log_in(server: PrivateRedis) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    for password in ("", "nopass", PASSWORDS["admin"]):
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, username="default", password=password,
                        socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # a user's name with another's password
        redis.Redis.from_url(broker_url(server, "api").replace(PASSWORDS["api"], PASSWORDS["worker"]),
                             socket_timeout=5).ping()


def test_the_healthcheck_pings_as_its_own_user(server: PrivateRedis) -> None:
    """The compose healthcheck's command line, on this server: PONG with the password start.sh made up;
    its user may run PING and nothing else."""
    import yaml

    test = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    password_file = server.workdir / "config" / "healthcheck-password"
    command = test[1].replace("$$", "$").replace("/run/compilesvc-redis/healthcheck-password", str(password_file))
    command = command.replace("redis-cli ", f"redis-cli -p {server.port} ")
    assert subprocess.run(["sh", "-c", command], timeout=30).returncode == 0
    wrong = command.replace(str(password_file), "/dev/null")
    assert subprocess.run(["sh", "-c", wrong], timeout=30).returncode != 0
    client = redis.Redis(host="127.0.0.1", port=server.port, username="healthcheck",
                         password=password_file.read_text(), socket_timeout=5)
    try:
        assert client.ping()
        for command_args in (("GET", "x"), ("LPUSH", "compile.x", "1"), ("CONFIG", "GET", "*"), ("INFO",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command_args)
    finally:
        client.close()


def test_start_sh_leaves_no_password_to_redis(server: PrivateRedis) -> None:
    """The ACL file holds hashes only, and redis-server's environment none of the passwords."""
    assert server.proc is not None
    acl = (server.workdir / "config" / "users.acl").read_text()
    assert all(password not in acl for password in PASSWORDS.values())
    environment = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert not [v for v in environment if v.startswith(b"REDIS_") and b"PASSWORD" in v]


def test_the_script_refuses_placeholders_and_bad_passwords(tmp_path: Path) -> None:
    placeholder = write_acl(tmp_path / "a.acl", REDIS_WORKER_PASSWORD="change-me-redis-worker")
    assert placeholder.returncode == 2 and "REDIS_WORKER_PASSWORD still holds a placeholder" in placeholder.stderr
    assert not (tmp_path / "a.acl").exists()
    allowed = write_acl(tmp_path / "b.acl", REDIS_WORKER_PASSWORD="Change_Me", ALLOW_PLACEHOLDER_SECRETS="true")
    assert allowed.returncode == 0, allowed.stderr
    for bad in ("p@ss", "with space", "a/b", "x:y"):
        done = write_acl(tmp_path / "c.acl", REDIS_API_PASSWORD=bad)
        assert done.returncode == 2 and "REDIS_API_PASSWORD may only use" in done.stderr, bad
    empty = write_acl(tmp_path / "d.acl", REDIS_RELAY_PASSWORD="")
    assert empty.returncode == 2 and "REDIS_RELAY_PASSWORD must be set" in empty.stderr
