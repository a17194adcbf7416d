"""What the views share within one app: the core services, the submitter, the manifest cache, metrics.

The manifest cache is what makes ``GET /v1/artifacts/{key}`` (the serving fleet's hot path) cheap: a
published manifest is immutable, so once parsed it is kept in a bounded in-process LRU and a cache hit
costs no database query and no store read; only the download URLs are signed per request (they
expire). The submitter reads published manifests through the same cache.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson
from flask import current_app
from sqlalchemy import select

from compilesvc.builds.submit import PUBLISHED_TRUST_SECONDS, Prepared, Submitter
from compilesvc.config.settings import Settings
from compilesvc.ledger.models import Artifact
from compilesvc.lifecycle.artifacts import describe, describe_layout, read_manifest, with_urls
from compilesvc.lifecycle.fetch_stats import FetchRecorder
from compilesvc.services import Services
from compilesvc.spec.manifest import ArtifactManifest
from compilesvc.states import ArtifactState
from compilesvc.store.base import ArtifactStore, StoreError, UrlSigner
from web.contract.problems import Problem
from web.contract.schemas import ArtifactOut
from web.server.metrics import ApiMetrics

if TYPE_CHECKING:
    from web.auth import TokenCache
    from web.server.ratelimit import SubmitLimiter

DEFAULT_MANIFEST_CACHE_SIZE = 2048
#: Submit bodies seen lately, prepared (:class:`compilesvc.builds.prepare.Prepared`): CI pipelines resubmit the
#: same bytes, and a cache-hit submit is then parse-, validation- and key-free.
DEFAULT_PREPARED_CACHE_SIZE = 1024
#: How long a key found neither in the ledger nor in the store is answered 404 without asking the store.
DEFAULT_ABSENT_SECONDS = 2.0
#: Larger bodies are prepared afresh: real specs are a few KiB, and a client must not be able to fill the
#: cache with megabyte-sized ones (this bounds it to about 1024 x 8 KiB of text, and the specs parsed from it).
MAX_PREPARED_BODY = 8192

K = TypeVar("K")
V = TypeVar("V")


class _Unsigned:
    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str:
        return ""


class Described:
    """A published manifest laid out for clients once (:func:`compilesvc.lifecycle.artifacts.describe_layout`), to be
    signed and encoded per request: the hot path pays one signature per file and an orjson encoding, not a
    model dump.

    Renders are reused within the same wall-clock second, so under load each key is signed at most once
    a second per process. That gives what signing each request would: both stores' URLs depend only on
    the second they are signed in (SigV4 presigning has one-second resolution and no nonce, expiring at
    the second's start + ttl; the local store rounds expiry *up* to the next second + ttl, so a URL
    reused within its second is still valid for at least ttl seconds).
    """

    __slots__ = ("_last", "checked", "etag", "layout", "manifest")

    def __init__(self, manifest: ArtifactManifest):
        self.manifest = manifest
        self.checked = time.monotonic()  # when the ledger last said published (see WebContext.published)
        self.layout = describe_layout(manifest)  # shared by every render: read, never changed
        # The manifest never changes; only the URLs signed into each render do: a weak validator (RFC 9110
        # 8.8.1) over the layout, so a format change of ours is a new tag too.
        self.etag = hashlib.sha256(orjson.dumps(self.layout, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
        # Renders are the documented ArtifactOut: checked once per manifest here, not per request.
        ArtifactOut.model_validate(with_urls(self.layout, _Unsigned(), 0))
        self._last: tuple[int, int, bytes] | None = None  # (second, ttl, JSON): replaced whole, never mutated

    def render(self, signer: UrlSigner, ttl: int) -> bytes:
        """The described manifest with URLs signed now, as JSON."""
        second = int(time.time())
        last = self._last
        if last is not None and last[0] == second and last[1] == ttl:
            return last[2]
        text = orjson.dumps(with_urls(self.layout, signer, ttl))
        self._last = (second, ttl, text)  # one tuple assignment: threads see the old or the new render
        return text


class LRU(Generic[K, V]):
    """A thread-safe map of at most ``maxsize`` entries, dropping the least recently used."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> V:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
        return value

    def drop(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


class ManifestCache:
    """Parsed published manifests (with their client layout) by artifact key, in an :class:`LRU`; the
    submitter reads published manifests through it too (:class:`compilesvc.lifecycle.artifacts.PublishedManifests`).

    Only *published* manifests may enter (callers check the ledger or read the create-only manifest
    document first). A manifest never changes, but retention may delete its artifact: an entry is trusted
    for ``revalidate_seconds`` before the ledger is asked again (:meth:`WebContext.published`).
    """

    def __init__(self, store: ArtifactStore, maxsize: int = DEFAULT_MANIFEST_CACHE_SIZE,
                 absent_seconds: float = DEFAULT_ABSENT_SECONDS,
                 revalidate_seconds: float = PUBLISHED_TRUST_SECONDS):
        self.store = store
        self.revalidate_seconds = revalidate_seconds
        self._lru: LRU[str, Described] = LRU(maxsize)
        self._absent: LRU[str, float] = LRU(maxsize)  # key -> monotonic time its absence stops being trusted
        self.absent_seconds = absent_seconds

    def known_absent(self, key: str) -> bool:
        """The store had no manifest for ``key`` (which the ledger does not know) moments ago."""
        until = self._absent.get(key)
        return until is not None and time.monotonic() < until

    def mark_absent(self, key: str) -> None:
        if self.absent_seconds > 0:
            self._absent.put(key, time.monotonic() + self.absent_seconds)

    def get(self, key: str) -> Described | None:
        return self._lru.get(key)

    def put(self, key: str, manifest: ArtifactManifest) -> Described:
        return self._lru.put(key, Described(manifest))

    def drop(self, key: str) -> None:
        self._lru.drop(key)

    def published_manifest(self, key: str) -> ArtifactManifest | None:
        entry = self.load(key, lambda: read_manifest(self.store, key))
        return entry.manifest if entry is not None else None

    def load(self, key: str, loader: Callable[[], ArtifactManifest | None]) -> Described | None:
        """The cached entry, else ``loader()`` (cached when it returns a manifest). Two threads missing at
        once may both load; the manifests are identical, so that costs a read, not correctness."""
        entry = self.get(key)
        if entry is None:
            manifest = loader()
            if manifest is not None:
                entry = self.put(key, manifest)
        return entry

    def __len__(self) -> int:
        return len(self._lru)


@dataclass
class WebContext:
    services: Services
    submitter: Submitter
    manifests: ManifestCache
    prepared: LRU[str, Prepared]  # submit body text -> its reusable preparation
    metrics: ApiMetrics
    public_url: str
    streams: threading.BoundedSemaphore  # live log streams this process may serve at once
    tokens: TokenCache  # principals checked lately (web.auth)
    submit_limiter: SubmitLimiter  # submits per token (web.server.ratelimit)
    fetches: FetchRecorder  # lookups by key, written in batches (retention's "last fetched")
    openapi: dict[str, Any] | None = None  # built on first request to /openapi.json

    @property
    def settings(self) -> Settings:
        return self.services.settings

    # -- URLs ----------------------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return self.public_url + path

    def build_url(self, build_id: int, suffix: str = "") -> str:
        return f"{self.public_url}/v1/builds/{build_id}{suffix}"

    # -- artifacts -----------------------------------------------------------------------------------

    def describe(self, manifest: ArtifactManifest) -> dict[str, Any]:
        """The manifest as clients see it, with download URLs signed now."""
        return describe(manifest, self.services.store, self.settings.url_ttl_seconds)

    def describe_json(self, entry: Described) -> bytes:
        """:meth:`describe` of a cached manifest as JSON: the hot path (see :class:`Described`)."""
        return entry.render(self.services.store, self.settings.url_ttl_seconds)

    def published_manifest(self, key: str) -> ArtifactManifest:
        return self.published(key).manifest

    def published(self, key: str, *, remember_absence: bool = False) -> Described:
        """The published manifest of ``key`` (cache, else ledger + store), or a 404 problem saying why not.

        A cached manifest is trusted for :attr:`ManifestCache.revalidate_seconds`, then the ledger is asked
        again (one indexed query): retention may have deleted the artifact, and waits longer than that
        before it removes any file. A key the ledger does not know is still looked up in the store: a
        manifest there is complete by construction (written create-only after every file it names), e.g.
        published by another region.
        With ``remember_absence`` (the fleet's lookup, which polls) a key in neither is remembered as absent
        for :attr:`ManifestCache.absent_seconds` and answered 404 from memory meanwhile: a set published at
        once by its submit (every bucket compiled already) shows that much later to a poller that asked
        just before.
        """
        entry = self.manifests.get(key)
        if entry is not None and time.monotonic() - entry.checked < self.manifests.revalidate_seconds:
            return entry
        not_found = Problem("artifact-not-found", f"no artifact has key {key}")
        if remember_absence and entry is None and self.manifests.known_absent(key):
            raise not_found  # a fleet polling for a key nobody built: answered from memory
        with self.services.sessions() as session:
            state = session.scalar(select(Artifact.state).where(Artifact.key == key))
        if entry is not None and state in (None, ArtifactState.PUBLISHED):
            entry.checked = time.monotonic()  # still published (or known to the store only): trusted again
            return entry
        if entry is not None:
            self.manifests.drop(key)
        if state == ArtifactState.DELETED:
            raise Problem("artifact-not-published", f"artifact {key} was deleted by retention; submit its spec "
                          "again to build it again", state=state)
        if state is not None and state != ArtifactState.PUBLISHED:
            raise Problem("artifact-not-published", f"artifact {key} is {state}, not published", state=state)
        manifest = read_manifest(self.services.store, key)
        if manifest is None:
            if state == ArtifactState.PUBLISHED:
                raise StoreError(f"artifact {key} is published but its manifest is missing from the store")
            if remember_absence:
                self.manifests.mark_absent(key)
            raise not_found
        return self.manifests.put(key, manifest)


def web() -> WebContext:
    """The current app's :class:`WebContext`."""
    ctx: WebContext = current_app.extensions["compilesvc"]
    return ctx
