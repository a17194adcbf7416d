"""Webhooks against a real local receiver: a signed event per build end, retried after a 500, every try
recorded and shown by the API; the docs' verification snippet accepts them; refused URLs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import update

from compilesvc.cli.daemon import RelayLoop
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import utcnow
from compilesvc.ledger.webhooks import WebhookDelivery
from compilesvc.notify.webhooks import ID_HEADER, verify
from tests.fixtures.docs import doc_block
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, fail_build, spec_for
from tests.web.test_submit import assert_problem

SECRET = "whsec-test-0123456789"


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST and answers the statuses it is given, in turn."""

    def __init__(self, statuses: list[int]):
        self.statuses = statuses
        self.received: list[tuple[dict[str, str], bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.received.append((dict(self.headers.items()), body, status))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver([500])
    yield server
    server.close()


def webhook_env(make_env: EnvFactory, ledger_url: str, **overrides: Any) -> Env:
    return make_env(ledger_url, webhook_allow_networks="127.0.0.0/8", webhook_secret=SECRET,
                    webhook_retry_seconds=0, **overrides)


def relay_pass(env: Env) -> int:
    """What the relay's webhook thread does each round (compilesvc.cli.daemon.RelayLoop)."""
    return RelayLoop(env.services, env.services.relay).deliver_webhooks()


def docs_verify() -> Any:
    """The verification snippet of docs/api.md, as a receiver would paste it."""
    scope: dict[str, Any] = {}
    exec(doc_block("api.md", "so a captured delivery cannot be replayed later", lang="python"), scope)
    return scope["verify"]


def test_a_build_end_is_delivered_signed_and_retried(make_env: EnvFactory, ledger_url: str,
                                                     receiver: Receiver) -> None:
    env = webhook_env(make_env, ledger_url)
    spec = {**spec_for(env.upload(), labels={"repo": "vision"}), "callbacks": [receiver.url]}
    build_id = env.submit(spec).json["build_id"]
    assert relay_pass(env) == 0  # nothing while it builds
    complete_build(env.services, build_id)

    assert relay_pass(env) == 1  # the first try: the receiver answers 500
    assert relay_pass(env) == 1  # due again at once here (retry delay 0): 200
    assert relay_pass(env) == 0
    assert [status for _, _, status in receiver.received] == [500, 200]
    (first_headers, first_body, _), (headers, body, _) = receiver.received
    assert body == first_body and headers[ID_HEADER] == first_headers[ID_HEADER]  # the same event, twice
    event = json.loads(body)
    assert event["type"] == "build.succeeded" and event["build"]["id"] == build_id
    assert event["build"]["labels"] == {"repo": "vision"} and event["build"]["artifact_url"].endswith(
        event["build"]["artifact_key"])
    assert verify(SECRET.encode(), headers, body)
    assert docs_verify()(SECRET.encode(), headers, body)
    assert not docs_verify()(b"another secret", headers, body)
    assert not docs_verify()(SECRET.encode(), headers, body.replace(b"succeeded", b"failed"))
    stale = {**headers, "Compilesvc-Webhook-Timestamp": str(int(headers["Compilesvc-Webhook-Timestamp"]) - 3600)}
    assert not verify(SECRET.encode(), stale, body)  # a captured delivery cannot be replayed later

    shown = env.client.get(f"/v1/builds/{build_id}/webhooks").json
    assert shown["urls"] == [receiver.url]
    [delivery] = shown["deliveries"]
    assert (delivery["state"], delivery["event"], delivery["id"]) == ("delivered", "build.succeeded",
                                                                       headers[ID_HEADER])
    assert [(a["attempt"], a["status_code"]) for a in delivery["attempts"]] == [(1, 500), (2, 200)]
    assert delivery["attempts"][0]["error"] == "HTTP 500" and delivery["delivered_at"] is not None


def test_failures_hits_and_cancels_notify_too(make_env: EnvFactory, ledger_url: str, receiver: Receiver) -> None:
    receiver.statuses.clear()
    env = webhook_env(make_env, ledger_url, team_webhooks={"web-tests": [receiver.url]})  # the env token's team
    uri = env.upload()
    failing = env.submit(spec_for(uri, buckets=((1, 4),))).json["build_id"]
    fail_build(env.services, failing)
    hit_source = env.submit(spec_for(uri, buckets=((2, 4),))).json["build_id"]
    complete_build(env.services, hit_source)
    hit = env.submit(spec_for(uri, buckets=((2, 4),))).json
    assert hit["outcome"] == "hit"
    cancelled = env.submit(spec_for(uri, buckets=((3, 4),))).json["build_id"]
    env.client.post(f"/v1/builds/{cancelled}/cancel")
    while relay_pass(env):
        pass
    events = sorted((json.loads(body)["build"]["id"], json.loads(body)["type"]) for _, body, _ in receiver.received)
    assert events == [(failing, "build.failed"), (hit_source, "build.succeeded"),
                      (hit["build_id"], "build.succeeded"), (cancelled, "build.cancelled")]


def test_a_receiver_that_never_answers_2xx_fails_after_the_last_try(make_env: EnvFactory, ledger_url: str,
                                                                   receiver: Receiver) -> None:
    receiver.statuses[:] = [503] * 10
    env = webhook_env(make_env, ledger_url, webhook_max_attempts=3)
    build_id = env.submit({**spec_for(env.upload()), "callbacks": [receiver.url]}).json["build_id"]
    complete_build(env.services, build_id)
    while relay_pass(env):
        pass
    [delivery] = env.client.get(f"/v1/builds/{build_id}/webhooks").json["deliveries"]
    assert delivery["state"] == "failed" and len(delivery["attempts"]) == 3 and len(receiver.received) == 3


def test_a_delivery_waits_for_its_backoff(make_env: EnvFactory, ledger_url: str, receiver: Receiver) -> None:
    env = make_env(ledger_url, webhook_allow_networks="127.0.0.0/8", webhook_retry_seconds=3600)
    build_id = env.submit({**spec_for(env.upload()), "callbacks": [receiver.url]}).json["build_id"]
    complete_build(env.services, build_id)
    assert relay_pass(env) == 1 and relay_pass(env) == 0  # 500, then an hour's wait
    with transaction(env.services.sessions) as session:  # the hour has passed
        session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow()))
    assert relay_pass(env) == 1
    assert [status for _, _, status in receiver.received] == [500, 200]


@pytest.mark.parametrize(("url", "words"), [
    ("http://169.254.169.254/latest/meta-data/", "cloud-metadata"),
    ("http://100.100.100.200/latest/meta-data/", "cloud-metadata"),
    ("http://100.64.0.7/hook", "CGNAT"),
    ("http://[2002:a9fe:a9fe::]/hook", "6to4 (carrying 169.254.169.254"),
    ("http://127.0.0.1:6379/", "loopback"),
    ("http://10.1.2.3/hook", "private"),
    ("http://user:pw@example.com/hook", "credentials"),
    ("http://no-such-host.invalid/hook", "cannot resolve"),
])
def test_callbacks_the_service_must_not_call_are_refused(env: Env, url: str, words: str) -> None:
    refused = env.submit({**spec_for(env.upload()), "callbacks": [url]})
    body = assert_problem(refused, 422, "callback-invalid")
    assert body["errors"][0]["field"] == "callbacks[0]" and words in body["errors"][0]["message"]


def test_callbacks_are_http_urls_and_never_in_the_key(env: Env, receiver: Receiver) -> None:
    assert_problem(env.submit({**spec_for(env.upload()), "callbacks": ["ftp://example.com/x"]}), 422, "spec-invalid")
    plain = env.client.post("/v1/artifacts/resolve", json=spec_for(env.upload())).json["key"]
    with_hook = env.client.post("/v1/artifacts/resolve",
                                json={**spec_for(env.upload()), "callbacks": ["https://example.com/x"]}).json["key"]
    assert plain == with_hook
