"""A model pinned to immutable bytes (:class:`PinnedModel`, the JSON that travels from the API to the
worker), and the errors that say why a model reference cannot be pinned or fetched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compilesvc.spec.checkpoint import CheckpointMaterial


class ModelRefError(ValueError):
    """The spec's model reference cannot be used; ``field`` and ``message`` say why (a client error)."""

    def __init__(self, message: str, *, field: str = "model.uri"):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ModelChangedError(ModelRefError):
    """The model's bytes are no longer the ones that were pinned (overwritten or deleted)."""


class ModelPinning(Exception):
    """The model is too large to hash inside a request and is being hashed in the background
    (:mod:`compilesvc.pinning.hash_jobs`): not a refusal, ask again in ``retry_after`` seconds. ``done`` of
    ``total`` bytes are read."""

    def __init__(self, what: str, done: int, total: int, retry_after: int):
        self.what, self.done, self.total, self.retry_after = what, done, total, retry_after
        percent = 100 * done // total if total else 100
        super().__init__(f"{what} is being hashed to pin it ({_size(done)} of {_size(total)} read, {percent}%); "
                         f"submit it again in {retry_after} s (compilesvc submit waits)")


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


@dataclass(frozen=True)
class PinnedModel:
    """A model pinned to immutable bytes. ``fetch`` is JSON: exactly which bytes to fetch, plus ``sha256``.

    ``fetch`` is one of ``{"kind": "blob", "sha256"}``,
    ``{"kind": "s3", "bucket", "key", "version_id" (or None), "etag", "size", "sha256"}`` or
    ``{"kind": "file", "path", "size", "mtime_ns", "sha256"}``; an hf-checkpoint directory's is
    ``{"kind": "s3-prefix", "bucket", "prefix", "objects", "sha256"}`` or ``{"kind": "file-dir", "path", "files",
    "sha256"}`` (:mod:`compilesvc.pinning.checkpoints`), or the blob of its archive.

    ``checkpoint`` (hf-checkpoint models only) is what the key takes from the checkpoint: its config.json and, when
    asked for at pinning, its weight files' sha256.
    """

    uri: str
    format: str
    sha256: str
    size: int
    fetch: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointMaterial | None = None

    def as_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "format": self.format, "sha256": self.sha256, "size": self.size,
                "fetch": self.fetch, "checkpoint": None if self.checkpoint is None else self.checkpoint.as_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PinnedModel:
        return cls(
            uri=str(data["uri"]),
            format=str(data["format"]),
            sha256=str(data["sha256"]),
            size=int(data["size"]),
            fetch=dict(data["fetch"]),
            checkpoint=CheckpointMaterial.from_json(data["checkpoint"]) if data.get("checkpoint") else None,
        )
