"""Model identity: turning a spec's ``model.uri`` into immutable bytes with a known sha256, and fetching them.

The artifact key contains the model's content sha256, never its URI, so a URI must be *pinned* before a
key can be computed: :meth:`ModelResolver.pin` resolves it to exactly one immutable set of bytes and
describes how to fetch those bytes again (:attr:`PinnedModel.fetch`, JSON that travels to the worker).
:meth:`ModelResolver.fetch` on the worker downloads exactly those bytes and re-verifies the sha256.

- ``blob:sha256:<hex>``: an upload already in the artifact store; the name is the content.
- ``s3://bucket/key``: pinned to the object's version id when the bucket is versioned (or ``version_id``
  is given), else to its ETag + size, by :mod:`compilesvc.pinning.s3_models`.
- ``file:///abs/path``: only with ``settings.allow_file_models`` (embedded/dev); pinned to path, size and
  mtime, with the sha256 remembered in-process.

Client mistakes raise :class:`~compilesvc.pinning.pins.ModelRefError` (a ValueError naming the field); a
model that changed after pinning raises :class:`~compilesvc.pinning.pins.ModelChangedError`; store/S3 outages
raise the store's ``StoreError`` family.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compilesvc.config.settings import Settings
from compilesvc.pinning.pins import ModelChangedError, ModelRefError, PinnedModel
from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store.base import SHA256_RE, ArtifactStore
from compilesvc.store.hashing import CHUNK_SIZE, copy_hashing, verified_file

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from sqlalchemy.orm import Session, sessionmaker

    from compilesvc.pinning.s3_models import S3Models

BLOB_PREFIX = "blob:sha256:"
_PIN_ATTEMPTS = 3
_FILE_CACHE_LIMIT = 4096


def file_uri_path(uri: str) -> Path:
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise ModelRefError("expected file:///absolute/path")
    path = Path(urllib.request.url2pathname(parsed.path))
    if not path.is_absolute():
        raise ModelRefError("expected file:///absolute/path")
    return path


class ModelResolver:
    """Pins model references (API side) and fetches pinned models (worker side).

    ``store`` is needed for ``blob:`` models; ``sessions`` (the ledger) remembers S3 pins across processes
    (None: compute, do not remember). ``s3_client`` defaults to one built from the settings with the
    standard credential chain.
    """

    def __init__(
        self,
        settings: Settings,
        store: ArtifactStore | None,
        sessions: sessionmaker[Session] | None,
        *,
        s3_client: S3Client | None = None,
    ):
        self.settings = settings
        self.store = store
        self.sessions = sessions
        self._s3_client = s3_client
        self._s3: S3Models | None = None
        self._file_hashes: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    @property
    def s3(self) -> S3Models:
        """S3 models, made on first use: boto3 and the ledger's tables load only for an ``s3://`` model, so
        ``compilesvc key`` on a client install (no server packages) hashes file and blob models without
        them."""
        if self._s3 is None:
            from compilesvc.pinning.s3_models import S3Models

            self._s3 = S3Models(self.settings, self.sessions, s3_client=self._s3_client)
        return self._s3

    @property
    def s3_client(self) -> S3Client:
        return self.s3.s3_client

    # -- pinning -------------------------------------------------------------------------------------

    def pin(self, ref: ModelRef, *, weight_digests: bool = False, sdk: str | None = None) -> PinnedModel:
        """Resolve ``ref`` to immutable bytes and their sha256 (:class:`ModelRefError` on client mistakes).

        An hf-checkpoint is pinned file by file with its key material (:mod:`compilesvc.pinning.checkpoints`);
        ``weight_digests`` asks for its weight files' sha256 too (a compile that writes pre-sharded weights), the
        files the NxDI of release ``sdk`` reads (its loader order; the newest when None).
        """
        if ref.format == "hf-checkpoint":
            return self._pin_checkpoint(ref, weight_digests, sdk)
        if ref.uri.startswith(BLOB_PREFIX):
            return self._pin_blob(ref)
        if ref.uri.startswith("s3://"):
            return self.s3.pin(ref)
        if ref.uri.startswith("file://"):
            return self._pin_file(ref)
        raise ModelRefError('expected "blob:sha256:<hex>", "s3://bucket/key" or "file:///abs/path"')

    def _pin_checkpoint(self, ref: ModelRef, weight_digests: bool, sdk: str | None) -> PinnedModel:
        from compilesvc.pinning import checkpoints

        layouts = checkpoints.layouts_for(sdk)
        if ref.uri.startswith(BLOB_PREFIX):
            blob = self._pin_blob(ref)
            return checkpoints.pin_blob(self, ref, blob.sha256, blob.size, weight_digests=weight_digests,
                                        layouts=layouts)
        if ref.uri.startswith("s3://"):
            if not ref.is_prefix:
                raise ModelRefError("an hf-checkpoint in S3 is a prefix holding the checkpoint directory: "
                                    "s3://bucket/prefix/ (ending in /)")
            from compilesvc.pinning.s3_prefixes import pin_prefix

            return pin_prefix(self.s3, ref, self.settings.hf_extract_max_files, weight_digests=weight_digests,
                              max_bytes=self.settings.hf_extract_max_bytes, layouts=layouts)
        if ref.uri.startswith("file://"):
            self._check_file_models_allowed()
            root = Path(os.path.realpath(file_uri_path(ref.uri)))
            if not root.is_dir():
                raise ModelRefError(f"{root} is not a directory: an hf-checkpoint is the checkpoint's directory "
                                    "(config.json and the weights)")
            return checkpoints.pin_directory(self, ref, root, weight_digests=weight_digests, layouts=layouts)
        raise ModelRefError('expected "blob:sha256:<hex>", "s3://bucket/prefix/" or "file:///abs/dir"')

    def _check_file_models_allowed(self) -> None:
        if not self.settings.allow_file_models:
            raise ModelRefError(
                "file:// models are disabled on this service (COMPILESVC_ALLOW_FILE_MODELS); "
                "upload the file with POST /v1/models or use s3://"
            )

    def _pin_blob(self, ref: ModelRef) -> PinnedModel:
        sha256 = ref.uri[len(BLOB_PREFIX) :]
        if not SHA256_RE.match(sha256):
            raise ModelRefError("expected blob:sha256:<64 lowercase hex digits>")
        if self.store is None:
            raise RuntimeError("ModelResolver needs an artifact store to pin blob: models")
        size = self.store.blob_size(sha256)
        if size is None:
            raise ModelRefError(f"blob sha256:{sha256} is not uploaded: upload the model first "
                                "(`compilesvc upload FILE`, or POST /v1/models)")
        return PinnedModel(ref.uri, ref.format, sha256, size, {"kind": "blob", "sha256": sha256})

    def _pin_file(self, ref: ModelRef) -> PinnedModel:
        self._check_file_models_allowed()
        path = Path(os.path.realpath(file_uri_path(ref.uri)))
        for _ in range(_PIN_ATTEMPTS):
            before = self._stat_model_file(path)
            cache_key = (str(path), before.st_size, before.st_mtime_ns)
            sha256 = self._file_hashes.get(cache_key)
            if sha256 is None:
                with open(path, "rb") as src:
                    copied = copy_hashing(src.read, None)
                after = self._stat_model_file(path)
                if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or (
                    copied.size != before.st_size
                ):
                    continue  # written to while we read it: hash again
                sha256 = copied.sha256
                with self._lock:
                    if len(self._file_hashes) >= _FILE_CACHE_LIMIT:
                        self._file_hashes.pop(next(iter(self._file_hashes)))
                    self._file_hashes[cache_key] = sha256
            fetch = {
                "kind": "file",
                "path": str(path),
                "size": before.st_size,
                "mtime_ns": before.st_mtime_ns,
                "sha256": sha256,
            }
            return PinnedModel(ref.uri, ref.format, sha256, before.st_size, fetch)
        raise ModelChangedError(f"{path} kept changing while it was being read; retry once writes to it stop")

    @staticmethod
    def _stat_model_file(path: Path) -> os.stat_result:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ModelRefError(f"{path} does not exist") from None
        except OSError as exc:
            raise ModelRefError(f"cannot read {path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise ModelRefError(f"{path} is a directory; upload a tar of the directory")
        if not stat.S_ISREG(st.st_mode):
            raise ModelRefError(f"{path} is not a regular file")
        if not os.access(path, os.R_OK):
            raise ModelRefError(f"{path} is not readable (permissions)")
        return st

    # -- fetching (worker side) ----------------------------------------------------------------------

    def fetch(self, pinned_fetch: dict[str, Any], dest: Path) -> None:
        """Write exactly the pinned bytes to ``dest`` (atomically), verifying their sha256. A checkpoint pinned file
        by file (``s3-prefix``, ``file-dir``) becomes a directory at ``dest``, each file verified against its pin;
        a checkpoint archive (``blob``) is written as the archive, which the worker extracts with its caps.

        :class:`ModelChangedError` when the source no longer holds them; :class:`IntegrityError` when
        bytes arrive that do not hash to the pinned sha256.
        """
        kind = pinned_fetch.get("kind")
        sha256 = str(pinned_fetch.get("sha256", ""))
        if not SHA256_RE.match(sha256):
            raise ValueError(f"pinned model fetch description lacks a sha256: {pinned_fetch!r}")
        dest = Path(dest)
        if kind == "blob":
            if self.store is None:
                raise RuntimeError("ModelResolver needs an artifact store to fetch blob: models")
            self.store.download_blob(sha256, dest)
        elif kind == "s3":
            self.s3.fetch(pinned_fetch, sha256, dest)
        elif kind == "file":
            self._fetch_file(pinned_fetch, sha256, dest)
        elif kind == "s3-prefix":
            from compilesvc.pinning.s3_prefixes import fetch_prefix

            fetch_prefix(self.s3, pinned_fetch, dest)
        elif kind == "file-dir":
            from compilesvc.pinning.checkpoints import fetch_directory

            fetch_directory(pinned_fetch, dest)
        else:
            raise ValueError(f"unknown pinned model kind {kind!r}")

    def _fetch_file(self, fetch: dict[str, Any], sha256: str, dest: Path) -> None:
        path, size, mtime_ns = Path(str(fetch["path"])), int(fetch["size"]), int(fetch["mtime_ns"])
        changed = ModelChangedError(
            f"{path} changed since it was pinned (size or mtime differ); resubmit the build to pin it again"
        )
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise changed

        with verified_file(dest, sha256, size, what="the model's bytes") as writer, open(path, "rb") as src:
            shutil.copyfileobj(src, writer, CHUNK_SIZE)  # verified_file hashes what passes


def content_sha256_for_key(ref: ModelRef, settings: Settings) -> str:
    """The model sha256 that goes into a key, for the ``compilesvc key`` CLI (no ledger, no store).

    ``file://`` is accepted here whatever ``allow_file_models`` says: the CLI hashes a file on the
    user's own machine, and the setting exists to stop the *service* reading its host's files.
    """
    return identity_for_key(ref, settings)[0]


def identity_for_key(ref: ModelRef, settings: Settings, *, weight_digests: bool = False, sdk: str | None = None
                     ) -> tuple[str, CheckpointMaterial | None]:
    """The model sha256 and (hf-checkpoint models) the checkpoint's key material, for the ``compilesvc key`` CLI,
    pinned as the service pins them (:func:`content_sha256_for_key`). An uploaded checkpoint archive cannot be
    read here: its config.json is in the service's store."""
    if ref.uri.startswith(BLOB_PREFIX):
        sha256 = ref.uri[len(BLOB_PREFIX) :]
        if not SHA256_RE.match(sha256):
            raise ModelRefError("expected blob:sha256:<64 lowercase hex digits>")
        if ref.format == "hf-checkpoint":
            raise ModelRefError("an uploaded checkpoint is keyed by the config.json inside it, which is in the "
                                "service's store: key the checkpoint's directory (file:///...) or S3 prefix, or ask "
                                "the service (POST /v1/artifacts/resolve)")
        return sha256, None
    if ref.uri.startswith("file://") and not settings.allow_file_models:
        settings = settings.model_copy(update={"allow_file_models": True})
    pinned = ModelResolver(settings, None, None).pin(ref, weight_digests=weight_digests, sdk=sdk)
    return pinned.sha256, pinned.checkpoint


__all__ = ["ModelResolver", "content_sha256_for_key", "identity_for_key"]
