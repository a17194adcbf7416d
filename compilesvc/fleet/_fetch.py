"""Getting an artifact into the local cache: from the cache itself when it is there and verifies (no
network at all), else from the API's manifest and the stores' URLs, every file in parallel, each blob
downloaded by one process however many start at once, damaged files fetched again.

Before any file is used, the manifest's signature is checked against the trusted keys
(:func:`compilesvc.signing.artifacts.verify_artifact`): on every open of a cached entry (offline too), and
before the first byte of a download. Files are then checked against that signed manifest.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compilesvc.fleet._binding import check_binding
from compilesvc.fleet._cache import ArtifactCache, CacheError, FilesDiffer, Placed, Verify, file_matches, placed_files
from compilesvc.fleet._download import ContentDiffers, DownloadError, download
from compilesvc.fleet._remote import FleetError, NotPublished, Published, Remote, Unreachable, Untrusted
from compilesvc.signing.artifacts import verify_artifact
from compilesvc.signing.keys import SignatureError, TrustedKeys, Verified
from compilesvc.spec.manifest import ArtifactManifest, FileEntry

DEFAULT_PARALLEL = 4


@dataclass(frozen=True)
class _Signed:
    """A signature bundle, as the cache keeps it, and what verifying it said."""

    verified: Verified
    bundle: bytes


class NotCached(FleetError):
    """Offline (or with a read-only cache) and the artifact is not in the cache."""


class ServedDiffers(FleetError):
    """A download's bytes are not the (signed) manifest's: the store holds other content than was published."""


class Progress:
    """What a fetch reports while it works (the CLI draws it; the library's default says nothing).
    Called from the download threads: implementations must be thread-safe."""

    def start(self, files: int, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def waiting(self, name: str) -> None:
        """Another process is downloading ``name``; this one waits for it instead of downloading twice."""


@dataclass
class FetchReport:
    """Where the artifact is and what it took: files and bytes in the set, and what came over the network."""

    key: str
    directory: Path
    manifest: ArtifactManifest
    files: int = 0
    bytes: int = 0
    downloaded: int = 0
    received_bytes: int = 0
    resumed: dict[str, int] = field(default_factory=dict)  # file -> bytes an interrupted download had left
    network: bool = False  # False: served from the cache with no request at all
    key_id: str = ""  # the trusted key that signed the manifest
    signature: builtins.bytes = b""  # the verified bundle, as the cache keeps it

    @property
    def from_cache(self) -> int:
        return self.files - self.downloaded


def spec_digest(spec: dict[str, Any]) -> str:
    """The digest a spec is remembered under in the cache (its canonical JSON)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Fetcher:
    """Fills one :class:`ArtifactCache` from one :class:`Remote` (None: offline, the cache only)."""

    def __init__(self, cache: ArtifactCache, remote: Remote | None, *, trusted: TrustedKeys,
                 verify: Verify = Verify.SHA256, parallel: int = DEFAULT_PARALLEL, progress: Progress | None = None):
        self.cache = cache
        self.trusted = trusted
        self.remote = remote
        self.verify = verify
        self.parallel = max(1, parallel)
        self.progress = progress or Progress()

    def key_for(self, spec: dict[str, Any]) -> str:
        """The key ``spec`` resolves to: asked of the API (and remembered), else remembered from last time."""
        return self.key_and_source(spec)[0]

    def key_and_source(self, spec: dict[str, Any]) -> tuple[str, str]:
        """:meth:`key_for`, and where the key came from (for :func:`check_binding`'s refusal)."""
        digest = spec_digest(spec)
        remembered = f"the cache's entry {self.cache.base / 'specs' / digest}"
        if self.remote is None:
            key = self.cache.key_for_spec(digest)
            if key is None:
                raise NotCached(f"offline, and this spec was never fetched into {self.cache.root}")
            return key, remembered
        try:
            key, state = self.remote.resolve(spec)
        except FleetError as exc:
            key_remembered = self.cache.key_for_spec(digest)
            if key_remembered is None or not isinstance(exc, Unreachable):
                raise
            return key_remembered, remembered
        if state != "published" and not self.cache.artifact_dir(key).is_dir():
            raise NotPublished(f"the spec resolves to key {key}, which is {state}, not published: build it "
                               "first (compilesvc submit SPEC --wait)", state)
        with contextlib.suppress(OSError):
            if self.cache.writable():
                self.cache.remember_spec(digest, key)
        return key, "the API's resolve answer"

    def fetch(self, key: str, *, with_logs: bool = False, spec: dict[str, Any] | None = None,
              key_source: str = "") -> FetchReport:
        """``key``'s verified directory in the cache, fetching what is missing or damaged. With ``spec`` (the key was
        the answer of ``key_source`` for it), the signed manifest must be that spec's artifact
        (:func:`~compilesvc.fleet._binding.check_binding`), checked before anything is downloaded or used."""
        try:
            manifest = self.cache.read(key)
        except CacheError:
            if self.remote is None or not self.cache.writable():
                raise
            self._discard(key)  # a corrupt manifest: the directory is refetched whole
            manifest = None
        if manifest is not None:
            signature = self._cached_signature(key, manifest)
            if spec is not None:
                check_binding(spec, manifest, source=key_source)
            placed = placed_files(manifest, with_logs=with_logs)
            damaged = self.cache.damaged(key, placed, self.verify)
            report = self._report(key, manifest, placed, signature)
            if not damaged:
                return report
            if self.remote is None or not self.cache.writable():
                names = ", ".join(str(p.relative) for p in damaged[:3])
                raise FilesDiffer(f"{len(damaged)} file(s) of {key} in {self.cache.artifact_dir(key)} are missing "
                                 f"or damaged ({names}) and this cache cannot refetch them "
                                 f"({'offline' if self.remote is None else 'read-only'})")
            lost = [p for p in damaged if not file_matches(self.cache.blob_path(p.entry.sha256), p.entry, self.verify)]
            if lost:  # else the blobs are whole and only the directory's links need putting back
                self._download_all(report, self._published(key), lost)
            self.cache.repair(key, damaged)
            return report
        if self.remote is None:
            raise NotCached(f"{key} is not in the cache {self.cache.root} (offline)")
        if not self.cache.writable():
            raise NotCached(f"{key} is not in the read-only cache {self.cache.root}")
        published = self._published(key)
        bundle = self.remote.signature(key)
        signature = self._check(bundle, published.manifest)  # before a byte of any file is downloaded
        if spec is not None:
            check_binding(spec, published.manifest, source=key_source)
        placed = placed_files(published.manifest, with_logs=with_logs)
        report = self._report(key, published.manifest, placed, signature)
        self._download_all(report, published, placed)
        self.cache.publish(published.manifest, placed, bundle)
        return report

    def _check(self, bundle: bytes, manifest: ArtifactManifest) -> _Signed:
        try:
            return _Signed(verify_artifact(self.trusted, bundle, manifest), bundle)
        except SignatureError as exc:
            raise Untrusted(str(exc), exc.key_id) from None

    def _cached_signature(self, key: str, manifest: ArtifactManifest) -> _Signed:
        """The cached entry's signature, verified; an entry cached before signatures gets its signature
        from the API (checked the same way, then kept), or is refused offline."""
        bundle = self.cache.read_signature(key)
        if bundle is not None:
            return self._check(bundle, manifest)
        if self.remote is None:
            raise Untrusted(f"{key} in {self.cache.artifact_dir(key)} has no signature (cached by an older "
                            "compilesvc): fetch it once online, or remove it from the cache")
        checked = self._check(self.remote.signature(key), manifest)
        with contextlib.suppress(OSError):
            if self.cache.writable():
                self.cache.write_signature(key, checked.bundle)
        return checked

    def _published(self, key: str) -> Published:
        assert self.remote is not None
        return self.remote.published(key)

    def _report(self, key: str, manifest: ArtifactManifest, placed: list[Placed],
                signature: _Signed) -> FetchReport:
        return FetchReport(key, self.cache.artifact_dir(key), manifest, files=len(placed),
                           bytes=sum(p.entry.size for p in placed), key_id=signature.verified.key_id,
                           signature=signature.bundle)

    def _discard(self, key: str) -> None:
        directory = self.cache.artifact_dir(key)
        aside = directory.with_name(f".{key}.{uuid.uuid4().hex[:8]}.discarded")
        with contextlib.suppress(FileNotFoundError):
            directory.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)

    def _download_all(self, report: FetchReport, published: Published, placed: list[Placed]) -> None:
        """Make a verified blob of every entry in ``placed`` (each distinct blob once), in parallel."""
        report.network = True
        entries: dict[str, tuple[str, FileEntry]] = {}
        for p in placed:
            entries.setdefault(p.entry.sha256, (str(p.relative), p.entry))
        self.progress.start(len(entries), sum(entry.size for _, entry in entries.values()))
        urls = _Urls(published, self.remote, report.key)
        lock = threading.Lock()

        def one(name: str, entry: FileEntry) -> None:
            transfer = self._ensure_blob(name, entry, urls)
            if transfer is not None:
                with lock:
                    report.downloaded += sum(1 for p in placed if p.entry.sha256 == entry.sha256)
                    report.received_bytes += transfer.received
                    if transfer.resumed_from:
                        report.resumed[name] = transfer.resumed_from

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(entries) or 1)) as pool:
            futures = [pool.submit(one, name, entry) for name, entry in entries.values()]
            errors = [f.exception() for f in futures]
        failures = [e for e in errors if e is not None]
        if failures:
            first = failures[0]
            differs = [e for e in failures if isinstance(e, ContentDiffers)]
            if differs:  # the store serves other bytes than the signed manifest names: say it is that
                raise ServedDiffers(f"artifact {report.key}: {differs[0]} (the manifest is signed by key "
                                    f"{report.key_id})") from None
            if isinstance(first, (DownloadError, FleetError, CacheError)):
                more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
                raise FleetError(f"{first}{more}") from None
            raise first

    def _ensure_blob(self, name: str, entry: FileEntry, urls: _Urls) -> Any:
        blob = self.cache.blob_path(entry.sha256)
        if file_matches(blob, entry, self.verify):
            self.progress.advance(entry.size)
            return None
        with self.cache.blob_lock(entry.sha256, on_wait=lambda: self.progress.waiting(name)):
            if file_matches(blob, entry, self.verify):  # another process got it while this one waited
                self.progress.advance(entry.size)
                return None
            partial = self.cache.partial_path(entry.sha256)
            transfer = download(lambda refresh: urls.get(entry.sha256, refresh), partial, entry,
                                progress=self.progress.advance)
            self.cache.install_blob(partial, entry.sha256)
            return transfer


class _Urls:
    """The download URLs of one fetch, refreshed (once for all threads) when one has expired."""

    def __init__(self, published: Published, remote: Remote | None, key: str):
        self._published = published
        self._remote = remote
        self._key = key
        self._lock = threading.Lock()

    def get(self, sha256: str, refresh: bool) -> str:
        with self._lock:
            if refresh and self._remote is not None:
                self._published = self._remote.published(self._key)
            return self._published.urls[sha256]



