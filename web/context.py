"""What the views share within one app: the core services, the submitter, the manifest cache, metrics.

The manifest cache is what makes ``GET /v1/artifacts/{key}`` (the serving fleet's hot path) cheap: a
published manifest is immutable, so once parsed it is kept in a bounded in-process LRU and a cache hit
costs no database query and no store read; only the download URLs are signed per request (they
expire). The submitter reads published manifests through the same cache.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from flask import current_app
from sqlalchemy import select

from compilesvc.artifacts import describe, read_manifest
from compilesvc.config import Settings
from compilesvc.ledger.models import Artifact
from compilesvc.manifest import ArtifactManifest
from compilesvc.services import Services
from compilesvc.states import ArtifactState
from compilesvc.store.base import ArtifactStore, StoreError
from compilesvc.submit import Prepared, Submitter
from web.metrics import ApiMetrics
from web.problems import Problem

DEFAULT_MANIFEST_CACHE_SIZE = 2048
#: Submit bodies seen lately, prepared (:class:`compilesvc.submit.Prepared`): CI pipelines resubmit the
#: same bytes, and a cache-hit submit is then parse-, validation- and key-free.
DEFAULT_PREPARED_CACHE_SIZE = 1024
#: Larger bodies are prepared afresh: real specs are a few KiB, and a client must not be able to fill the
#: cache with megabyte-sized ones (this bounds it to about 1024 x 8 KiB of text, and the specs parsed from it).
MAX_PREPARED_BODY = 8192

K = TypeVar("K")
V = TypeVar("V")


class _RecordingStore:
    """Stands in for the store while :func:`describe` lays a manifest out once: each ``blob_url`` call
    returns a unique marker and is remembered, so that the document can be serialised once and the real,
    freshly signed URLs spliced into the text per request (see :class:`Described`)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.calls: list[tuple[str, str | None]] = []

    def blob_url(self, sha256: str, *, expires_in: int, filename: str | None = None) -> str:
        self.calls.append((sha256, filename))
        return f"{self.token}-{len(self.calls) - 1}"


class Described:
    """A published manifest as :func:`describe` lays it out, serialised once: ``segments`` is the JSON text
    split around its download URLs, ``urls`` the (sha256, filename) each gap is signed for. Rendering costs
    one signature per file and a string join, instead of a model dump and a JSON encoding per request.
    ``segments`` is None when the layout could not be split (then every render calls :func:`describe`).

    Renders are reused within the same wall-clock second, so under load each key is signed at most once
    a second per process. That gives what signing each request would: both stores' URLs depend only on
    the second they are signed in (SigV4 presigning has one-second resolution and no nonce, expiring at
    the second's start + ttl; the local store rounds expiry *up* to the next second + ttl, so a URL
    reused within its second is still valid for at least ttl seconds).
    """

    __slots__ = ("_last", "manifest", "segments", "urls")

    def __init__(self, manifest: ArtifactManifest, segments: tuple[str, ...] | None,
                 urls: tuple[tuple[str, str | None], ...]):
        self.manifest = manifest
        self.segments = segments
        self.urls = urls
        self._last: tuple[int, int, str] | None = None  # (second, ttl, text): replaced whole, never mutated

    @classmethod
    def of(cls, manifest: ArtifactManifest, ttl: int) -> Described:
        recorder = _RecordingStore()
        try:
            text = json.dumps(describe(manifest, cast(ArtifactStore, recorder), ttl), ensure_ascii=False,
                              separators=(",", ":"))
        except AttributeError:  # describe() wanted more of the store than blob_url: no shortcut
            return cls(manifest, None, ())
        segments = re.split(rf'"{recorder.token}-\d+"', text)
        if len(segments) != len(recorder.calls) + 1:  # a URL was not a whole JSON string: no shortcut
            return cls(manifest, None, ())
        return cls(manifest, tuple(segments), tuple(recorder.calls))

    def render(self, store: ArtifactStore, ttl: int) -> str:
        second = int(time.time())
        last = self._last
        if last is not None and last[0] == second and last[1] == ttl:
            return last[2]
        if self.segments is None:
            text = json.dumps(describe(self.manifest, store, ttl), ensure_ascii=False, separators=(",", ":"))
        else:
            parts = [self.segments[0]]
            for (sha256, filename), segment in zip(self.urls, self.segments[1:], strict=True):
                parts.append(json.dumps(store.blob_url(sha256, expires_in=ttl, filename=filename)))
                parts.append(segment)
            text = "".join(parts)
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

    def __len__(self) -> int:
        return len(self._items)


class ManifestCache:
    """Parsed published manifests (with their serialised layout) by artifact key, in an :class:`LRU`.

    Only *published* manifests may enter (callers check the ledger or read the create-only manifest
    document first), which is what makes caching them forever correct.
    """

    def __init__(self, ttl: int, maxsize: int = DEFAULT_MANIFEST_CACHE_SIZE):
        self.ttl = ttl
        self._lru: LRU[str, Described] = LRU(maxsize)

    def get(self, key: str) -> Described | None:
        return self._lru.get(key)

    def put(self, key: str, manifest: ArtifactManifest) -> Described:
        return self._lru.put(key, Described.of(manifest, self.ttl))

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


class CachingSubmitter(Submitter):
    """The core submitter, reading published manifests through the API's cache.

    A cache-hit submit then costs the ledger write of the build row and nothing from the store.
    """

    def __init__(self, services: Services, cache: ManifestCache):
        super().__init__(services)
        self._cache = cache

    def _published_manifest(self, key: str) -> ArtifactManifest | None:
        entry = self._cache.load(key, lambda: read_manifest(self.services.store, key))
        return entry.manifest if entry is not None else None


@dataclass
class WebContext:
    services: Services
    submitter: CachingSubmitter
    manifests: ManifestCache
    prepared: LRU[str, Prepared]  # submit body text -> its reusable preparation
    metrics: ApiMetrics
    public_url: str
    streams: threading.BoundedSemaphore  # live log streams this process may serve at once
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

    def describe_json(self, entry: Described) -> str:
        """:meth:`describe` of a cached manifest as JSON text: the hot path (see :class:`Described`)."""
        return entry.render(self.services.store, self.settings.url_ttl_seconds)

    def published_manifest(self, key: str) -> ArtifactManifest:
        return self.published(key).manifest

    def published(self, key: str) -> Described:
        """The published manifest of ``key`` (cache, else ledger + store), or a 404 problem saying why not.

        A key the ledger does not know is still looked up in the store: a manifest there is complete by
        construction (written create-only after every file it names), e.g. published by another region.
        """
        entry = self.manifests.get(key)
        if entry is not None:
            return entry
        with self.services.sessions() as session:
            state = session.scalar(select(Artifact.state).where(Artifact.key == key))
        if state is not None and state != ArtifactState.PUBLISHED:
            raise Problem("artifact-not-published", f"artifact {key} is {state}, not published", state=state)
        manifest = read_manifest(self.services.store, key)
        if manifest is None:
            if state == ArtifactState.PUBLISHED:
                raise StoreError(f"artifact {key} is published but its manifest is missing from the store")
            raise Problem("artifact-not-found", f"no artifact has key {key}")
        return self.manifests.put(key, manifest)


def web() -> WebContext:
    """The current app's :class:`WebContext`."""
    ctx: WebContext = current_app.extensions["compilesvc"]
    return ctx
