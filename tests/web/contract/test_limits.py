"""Abuse limits per token: the submit rate (in process, and shared through Redis by several API processes),
the concurrent-compile quota, and upload sizes per scope. A refusal writes nothing."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import func, select

from compilesvc.ledger.models import Build
from tests.fixtures.tokens import bearer, make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, spec_for
from tests.web.test_submit import assert_problem
from web.server import ratelimit

REDIS_URL = os.environ.get("COMPILESVC_TEST_REDIS", "redis://127.0.0.1:6379/0")


def builds(env: Env) -> int:
    with env.services.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Build)) or 0)


def test_the_submit_rate_is_per_token(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, submit_rate_limit="2/minute")
    spec = spec_for(env.upload())
    ci, other = (make_token(env.services.sessions, "submit", owner=name) for name in ("ci", "other"))
    assert [env.submit(spec, **bearer(ci)).status_code for _ in range(2)] == [202, 202]
    before = builds(env)
    refused = env.submit(spec, **bearer(ci))
    body = assert_problem(refused, 429, "rate-limited")
    assert 1 <= int(refused.headers["Retry-After"]) <= 60 and body["retry_after"] == int(refused.headers["Retry-After"])
    assert "2 per 1 minute" in body["detail"]
    assert builds(env) == before  # refused before anything was written
    assert env.submit(spec, **bearer(other)).status_code == 202  # another token has its own count
    assert env.client.get("/v1/builds").status_code == 200  # reads are not limited


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"test-limits-{uuid.uuid4().hex[:12]}-"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def test_api_processes_share_one_count_through_redis(make_env: EnvFactory, sqlite_url: str, redis_prefix: str) -> None:
    settings = {"submit_rate_limit": "3/minute", "broker_url": REDIS_URL, "broker_key_prefix": redis_prefix}
    first = make_env(sqlite_url, **settings)
    second = make_env(sqlite_url, store_url=first.settings.resolved_store_url, **settings)  # two API processes
    token = make_token(first.services.sessions, "submit", owner="ci")
    spec = spec_for(first.upload())
    answers = [env.submit(spec, **bearer(token)).status_code for env in (first, second, first, second)]
    assert answers == [202, 202, 202, 429]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert list(client.scan_iter(match=f"{redis_prefix}compilesvc-limits*"))  # counted under the prefix
    finally:
        client.close()


def test_a_dead_limiter_store_lets_submits_through(make_env: EnvFactory, sqlite_url: str) -> None:
    # Redis away: the broker's outbox keeps submits safe, and the limiter must not refuse them instead.
    env = make_env(sqlite_url, submit_rate_limit="1/minute", broker_url="redis://127.0.0.1:1/0",
                   broker_socket_timeout_seconds=0.5)
    spec = spec_for(env.upload())
    assert [env.submit(spec).status_code for _ in range(2)] == [202, 202]


def test_the_compile_quota_counts_compiles_in_flight(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, max_compiles_per_token=3)
    ci = make_token(env.services.sessions, "submit", owner="ci")
    two = spec_for(env.upload(), buckets=((1, 8), (2, 8)))
    first = env.submit(two, **bearer(ci))
    assert first.status_code == 202
    other = spec_for(env.upload(b"other model"), buckets=((1, 8), (2, 8)))
    before = builds(env)
    refused = env.submit(other, **bearer(ci))
    body = assert_problem(refused, 429, "quota-exceeded")
    assert (body["in_flight"], body["needed"], body["limit"]) == (2, 2, 3) and refused.headers["Retry-After"]
    assert builds(env) == before
    assert env.submit(two, **bearer(ci)).json["outcome"] == "join"  # joins start no compile
    assert_problem(env.submit(spec_for(env.upload(b"big"), buckets=((1, 1), (2, 2), (3, 3), (4, 4))),
                              **bearer(ci)), 422, "spec-over-quota")
    assert env.submit(other).status_code == 202  # the admin has no quota

    complete_build(env.services, first.json["build_id"])
    assert env.submit(two, **bearer(ci)).json["outcome"] == "hit"
    assert env.submit(spec_for(env.upload(b"third"), buckets=((1, 8), (2, 8))), **bearer(ci)).status_code == 202


def test_uploads_are_limited_per_scope(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, max_upload_bytes=1000, max_upload_bytes_admin=5000)
    submitter = make_token(env.services.sessions, "submit", owner="ci")
    body = b"m" * 2000
    refused = env.client.post("/v1/models", data=body, content_type="application/octet-stream",
                              headers=bearer(submitter))
    assert assert_problem(refused, 413, "upload-too-large")["max_bytes"] == 1000
    assert env.client.post("/v1/models", data=body, content_type="application/octet-stream").status_code == 201
    reader = make_token(env.services.sessions, "read", owner="r")
    assert_problem(env.client.post("/v1/models", data=b"x", content_type="application/octet-stream",
                                   headers=bearer(reader)), 403, "forbidden")


def _threads_created() -> int:
    """How many unnamed threads this process has created so far (each takes the next "Thread-N")."""
    probe = threading.Thread(target=lambda: None)
    return int(probe.name.split("-")[1].split(" ")[0])


def test_counting_in_memory_starts_no_thread_per_submit(make_env: EnvFactory, sqlite_url: str) -> None:
    # Found by profiling cache-hit submits (issue 12): limits' MemoryStorage starts a 10 ms Timer thread
    # whenever the last one has finished, i.e. about one new thread per submit under a steady load.
    env = make_env(sqlite_url, submit_rate_limit="1000000/minute")
    limiter = env.app.extensions["compilesvc"].submit_limiter
    principal = env.app.extensions["compilesvc"].tokens.by_secret(env.token)
    before = _threads_created()
    for _ in range(20):
        limiter.check(principal)
        time.sleep(0.015)  # past the library's 10 ms timer, which would then start another
    assert _threads_created() - before <= 1  # the probe itself


def test_expired_counts_are_swept_from_memory(make_env: EnvFactory, sqlite_url: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "SWEEP_SECONDS", 0.05)
    env = make_env(sqlite_url, submit_rate_limit="2/second")
    storage = env.app.extensions["compilesvc"].submit_limiter.strategy.storage
    spec = spec_for(env.upload())
    assert env.submit(spec).status_code == 202
    assert storage.storage  # counted
    deadline = time.monotonic() + 10
    while storage.storage and time.monotonic() < deadline:  # both windows (2 s) expire, then a sweep
        time.sleep(0.1)
    assert not storage.storage
