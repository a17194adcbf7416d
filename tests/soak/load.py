"""The soak's load driver, shared by ``tests/soak/test_soak.py`` and ``bench.soak``: a day of traffic for a few
seconds or minutes, every request through the proxy, and the checks that nothing went wrong.

Several clients (threads, each with its own submit-scoped token, kept-alive connection and signed-in UI
session) each loop over a weighted mix of what a day brings (:data:`DAY`): mostly artifact lookups (the
fleet's hot path) and resubmits that hit, then build status polls, downloads, UI pages, log pages, and a few
real builds: ``new`` specs (a shape never seen before, sometimes beside a bucket built already), and ``join``
resubmits of a spec still building. One new spec in :data:`SLOW_EVERY` compiles slowly (the double's
``slow:N``) so that joins find something in flight. New builds are capped (:data:`MAX_IN_FLIGHT` artifacts
at once, beyond that a ``new`` pick becomes a ``hit``) so the backlog stays what two workers drain.

What counts as an error (:class:`Tally`): a connection error or timeout, any 5xx, a status the request
should not get (a lookup of a published key that is not 200, a hit that was not a hit...), a download whose
bytes do not match the manifest's sha256 and size. The one tolerated refusal is a submit's 503 with
Retry-After (the documented "try again"), retried after it and counted apart. After the load,
:meth:`Day.drain` waits for every accepted build to be terminal and looks every succeeded one's key up:
a build still not terminal at the deadline, or succeeded without a published artifact, is lost.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from tests.fixtures.tokens import bearer
from tests.workers.conftest import NEURON_SDK

#: Relative weights of each request kind in a day (a real day: mostly lookups and hits).
DAY: dict[str, int] = {"lookup": 30, "hit": 14, "poll": 14, "ui": 12, "download": 7, "new": 8, "logs": 5,
                       "revalidate": 5, "join": 5}
#: One new spec in this many compiles slowly, so that identical submits can join it.
SLOW_EVERY = 4
SLOW_BEHAVIOUR = "slow:3"
#: Artifacts building at once, at most: past it, a ``new`` pick resubmits a published spec instead.
MAX_IN_FLIGHT = 6
UI_PAGES = ("/", "/builds/{build}", "/artifacts", "/workers", "/stats")
TERMINAL = ("succeeded", "failed", "cancelled")
TIMEOUT = 60.0
_CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


@dataclass
class Tally:
    """Every request's kind, latency and verdict; the first errors word for word."""

    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)  # "new->new", "join->hit": asked -> answered
    retried_503: int = 0
    messages: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, kind: str, seconds: float, error: str | None = None) -> None:
        with self.lock:
            self.requests[kind] += 1
            self.latencies.setdefault(kind, []).append(seconds)
            if error is not None:
                self.errors[kind] += 1
                if len(self.messages) < 50:
                    self.messages.append(f"{kind}: {error}")

    def error(self, kind: str, message: str) -> None:
        """An error found after the request itself was answered (a download's bytes, an outcome)."""
        with self.lock:
            self.errors[kind] += 1
            if len(self.messages) < 50:
                self.messages.append(f"{kind}: {message}")

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentile(self, kind: str, q: float) -> float:
        ordered = sorted(self.latencies.get(kind, []))
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


@dataclass
class Drained:
    accepted: int
    terminal: int
    lost: dict[int, str]  # build id -> its last state (or why it is counted lost)
    states: Counter[str]
    unpublished: list[str]  # keys of succeeded builds that do not look up as published


class Day:
    """What the clients share: the specs in flight and published, every accepted build, the tally."""

    def __init__(self, base: str, model_uri: str, tally: Tally, seed: int = 0):
        self.base = base
        self.model_uri = model_uri
        self.tally = tally
        self.lock = threading.Lock()
        self.shapes = itertools.count()
        self.building: dict[str, dict[str, Any]] = {}  # artifact key -> spec, while building
        self.published: dict[str, dict[str, Any]] = {}  # artifact key -> spec
        self.accepted: dict[int, str] = {}  # build id -> artifact key
        self.state: dict[int, str] = {}  # build id -> last state seen
        self.etags: dict[str, str] = {}
        self.random = random.Random(seed)
        self.stop = threading.Event()

    # -- the shared state -------------------------------------------------------------------------------

    def new_spec(self) -> dict[str, Any] | None:
        with self.lock:
            if len(self.building) >= MAX_IN_FLIGHT:
                return None
            n = next(self.shapes)
            reuse = [s for s in self.published.values() if s["compiler"]["args"] == ["--double-behaviour=ok"]]
        behaviour = SLOW_BEHAVIOUR if n % SLOW_EVERY == SLOW_EVERY - 1 else "ok"
        buckets = [{"batch_size": 1, "seq_len": 16 + n}]
        if behaviour == "ok" and reuse and n % 3 == 0:  # beside a bucket compiled already: partly reused
            buckets.append(dict(self.random.choice(reuse)["buckets"][0]))
        return {"model": {"uri": self.model_uri, "format": "hlo", "name": "soak"}, "target": "inf2",
                "sdk": NEURON_SDK, "compiler": {"args": [f"--double-behaviour={behaviour}"]}, "buckets": buckets}

    def pick(self, pool: str) -> Any:
        """A random artifact key (``building``/``published``) or build id (``builds``, ``pending``)."""
        with self.lock:
            if pool == "pending":
                choices: list[Any] = [b for b in self.accepted if self.state.get(b) not in TERMINAL]
            elif pool == "builds":
                choices = list(self.accepted)
            else:
                choices = list(getattr(self, pool))
            return self.random.choice(choices) if choices else None

    def accept(self, body: dict[str, Any], spec: dict[str, Any]) -> None:
        with self.lock:
            build_id, key = int(body["build_id"]), str(body["artifact_key"])
            self.accepted[build_id] = key
            self.state[build_id] = body["state"]
            if body["state"] == "building":
                self.building.setdefault(key, spec)
            elif body["state"] == "succeeded":
                self.published.setdefault(key, spec)

    def saw(self, build: dict[str, Any]) -> None:
        with self.lock:
            build_id, state = int(build["build_id"]), str(build["state"])
            self.state[build_id] = state
            key = self.accepted.get(build_id)
            if key is not None and state in TERMINAL:
                spec = self.building.pop(key, None)
                if state == "succeeded" and spec is not None:
                    self.published.setdefault(key, spec)

    # -- the end ---------------------------------------------------------------------------------------

    def drain(self, http: requests.Session, timeout: float) -> Drained:
        """Poll every accepted build until terminal (or ``timeout``); look up every succeeded build's key."""
        deadline = time.monotonic() + timeout
        lost: dict[int, str] = {}
        while True:
            pending = [b for b in self.accepted if self.state.get(b) not in TERMINAL]
            for build_id in pending:
                try:
                    response = http.get(f"{self.base}/v1/builds/{build_id}", timeout=TIMEOUT)
                except requests.RequestException as exc:
                    lost[build_id] = f"unreadable: {type(exc).__name__}"
                    continue
                if response.status_code == 200:
                    self.saw(response.json())
                else:
                    lost[build_id] = f"GET answered {response.status_code}"
            pending = [b for b in self.accepted if self.state.get(b) not in TERMINAL]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        lost = {b: lost.get(b, self.state.get(b, "never seen")) for b in pending}
        unpublished = []
        for key in sorted({k for b, k in self.accepted.items() if self.state.get(b) == "succeeded"}):
            response = http.get(f"{self.base}/v1/artifacts/{key}", timeout=TIMEOUT)
            if response.status_code != 200:
                unpublished.append(f"{key}: {response.status_code} {response.text[:200]}")
        return Drained(accepted=len(self.accepted), terminal=len(self.accepted) - len(pending), lost=lost,
                       states=Counter(self.state[b] for b in self.accepted), unpublished=unpublished)


class Client:
    """One client of the day: its own token, connection pool and UI session; ``run`` until ``day.stop``."""

    def __init__(self, day: Day, token: str, seed: int):
        self.day = day
        self.tally = day.tally
        self.random = random.Random(seed)
        self.api = requests.Session()
        self.api.headers.update(bearer(token))
        self.token = token
        self.ui = requests.Session()
        self.downloads = requests.Session()  # the store's presigned URLs: no bearer token goes there
        kinds, weights = zip(*DAY.items(), strict=True)
        self.kinds: tuple[str, ...] = kinds
        self.weights: tuple[int, ...] = weights

    def call(self, kind: str, method: str, url: str, expect: tuple[int, ...] = (200,),
             session: requests.Session | None = None, **kwargs: Any) -> requests.Response | None:
        """One request, timed and judged: the response when its status was expected, else None."""
        started = time.monotonic()
        try:
            response = (session or self.api).request(method, url, timeout=TIMEOUT, **kwargs)
        except requests.RequestException as exc:
            self.tally.done(kind, time.monotonic() - started, f"{method} {url}: {type(exc).__name__}: {exc}")
            return None
        seconds = time.monotonic() - started
        if response.status_code not in expect:
            self.tally.done(kind, seconds, f"{method} {url} answered {response.status_code}: {response.text[:300]}")
            return None
        self.tally.done(kind, seconds)
        return response

    def login(self) -> None:
        """Sign in as the UI does: the login form's CSRF token, then the form post (303 to the history)."""
        page = self.call("ui", "GET", f"{self.day.base}/login", session=self.ui)
        match = _CSRF_RE.search(page.text) if page is not None else None
        if match is None:
            self.tally.error("ui", "the login page has no csrf_token field")
            return
        self.call("ui", "POST", f"{self.day.base}/login", expect=(303,), session=self.ui, allow_redirects=False,
                  data={"token": self.token, "csrf_token": match.group(1), "next": "/"})

    def run(self) -> None:
        self.login()
        while not self.day.stop.is_set():
            kind = self.random.choices(self.kinds, self.weights)[0]
            try:
                getattr(self, f"do_{kind}")()
            except (ValueError, KeyError, TypeError) as exc:  # an answer not shaped as documented
                self.tally.error(kind, f"unexpected answer: {type(exc).__name__}: {exc}")

    # -- submits ---------------------------------------------------------------------------------------

    def submit(self, asked: str, spec: dict[str, Any], expected: tuple[str, ...]) -> None:
        """POST /v1/builds; a 503 + Retry-After is waited out (at most 2 s a time, 30 s in all) and counted."""
        deadline = time.monotonic() + 30
        while True:
            response = self.call(asked, "POST", f"{self.day.base}/v1/builds", expect=(200, 202, 503), json=spec)
            if response is None:
                return
            if response.status_code != 503:
                break
            retry_after = response.headers.get("Retry-After", "")
            if not retry_after.isdigit() or time.monotonic() > deadline:
                self.tally.error(asked, f"503 {'without Retry-After' if not retry_after.isdigit() else 'for 30 s'}: "
                                        f"{response.text[:300]}")
                return
            with self.tally.lock:
                self.tally.retried_503 += 1
            time.sleep(min(float(retry_after), 2.0))
        body = response.json()
        self.day.accept(body, spec)
        with self.tally.lock:
            self.tally.outcomes[f"{asked}->{body['outcome']}"] += 1
        if body["outcome"] not in expected:
            self.tally.error(asked, f"answered {body['outcome']} (expected {' or '.join(expected)}): "
                                    f"build {body['build_id']}")

    def do_new(self) -> None:
        spec = self.day.new_spec()
        if spec is None:  # enough building already
            self.do_hit()
            return
        self.submit("new", spec, ("new",))

    def do_hit(self) -> None:
        key = self.day.pick("published")
        if key is None:
            self.do_lookup()
            return
        self.submit("hit", self.day.published[key], ("hit",))

    def do_join(self) -> None:
        key = self.day.pick("building")
        spec = self.day.building.get(key) if key is not None else None
        if spec is None:
            self.do_hit()
            return
        self.submit("join", spec, ("join", "hit"))  # it may have been published since it was picked

    # -- reads -----------------------------------------------------------------------------------------

    def do_lookup(self) -> dict[str, Any] | None:
        key = self.day.pick("published")
        if key is None:
            return None
        response = self.call("lookup", "GET", f"{self.day.base}/v1/artifacts/{key}")
        if response is None:
            return None
        self.day.etags[key] = response.headers.get("ETag", "")
        return dict(response.json())

    def do_revalidate(self) -> None:
        """A fleet host that has the manifest already: If-None-Match with its ETag answers 304."""
        key = self.day.pick("published")
        etag = self.day.etags.get(key) if key is not None else None
        if not etag:
            self.do_lookup()
            return
        self.call("revalidate", "GET", f"{self.day.base}/v1/artifacts/{key}", expect=(304,),
                  headers={"If-None-Match": etag})

    def do_download(self) -> None:
        """The manifest's files of one bucket, from its URLs, each checked against its sha256 and size."""
        manifest = self.do_lookup()
        if manifest is None:
            return
        bucket = self.random.choice(manifest["buckets"])
        for entry in [*bucket["files"], *([bucket["log"]] if bucket.get("log") else [])]:
            response = self.call("download", "GET", entry["url"], session=self.downloads)
            if response is None:
                continue
            got, digest = len(response.content), hashlib.sha256(response.content).hexdigest()
            if digest != entry["sha256"] or got != entry["size"]:
                self.tally.error("download", f"{entry['path']} of {manifest['key'][:12]}: {got} bytes sha256 "
                                             f"{digest[:12]}, manifest: {entry['size']} {entry['sha256'][:12]}")

    def do_poll(self) -> None:
        build_id = self.day.pick("pending" if self.random.random() < 0.7 else "builds") or self.day.pick("builds")
        if build_id is None:
            return
        response = self.call("poll", "GET", f"{self.day.base}/v1/builds/{build_id}")
        if response is not None:
            self.day.saw(response.json())

    def do_logs(self) -> None:
        build_id = self.day.pick("builds")
        if build_id is not None:
            self.call("logs", "GET", f"{self.day.base}/v1/builds/{build_id}/logs", params={"limit": 200})

    def do_ui(self) -> None:
        page = self.random.choice(UI_PAGES)
        build_id = self.day.pick("builds")
        if "{build}" in page and build_id is None:
            page = "/"
        response = self.call("ui", "GET", self.day.base + page.format(build=build_id), session=self.ui,
                             allow_redirects=False)
        if response is not None and not response.headers.get("Content-Type", "").startswith("text/html"):
            self.tally.error("ui", f"{page} answered {response.headers.get('Content-Type')}")


def run_clients(day: Day, tokens: list[str], seconds: float,
                checkpoints: dict[float, Callable[[], None]] | None = None) -> float:
    """Every client for ``seconds``; ``checkpoints`` run in this thread at their second of the load (a
    process sample after the warm-up, say). Returns the seconds the load ran."""
    threads = [threading.Thread(target=Client(day, token, seed=i + 1).run, name=f"soak-client-{i}", daemon=True)
               for i, token in enumerate(tokens)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        for at, action in sorted((checkpoints or {}).items()):
            day.stop.wait(max(0.0, started + at - time.monotonic()))
            action()
        day.stop.wait(max(0.0, started + seconds - time.monotonic()))
    finally:
        day.stop.set()
        for thread in threads:
            thread.join(TIMEOUT + 10)
    return time.monotonic() - started
