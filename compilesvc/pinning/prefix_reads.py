"""What the key read from an S3 prefix's small files, remembered by those files' pinned identities.

Every submit and every ``POST /v1/artifacts/resolve`` (each fleet host's ``fetch --spec`` / ``serve-env --spec``)
pins an ``s3://bucket/prefix/`` checkpoint again. Its listing says which small files the key reads (config.json,
and the weight index the NxDI release's loader order picks) and each one's identity: bucket, key, version id (or
none in an unversioned bucket), ETag and size. A reading (config.json parsed, its sha256, the shards the index
names) is remembered in the ledger's ``checkpoint_pins`` under a digest of those identities, so pinning an
unchanged prefix again costs its listing and one ledger read, and GETs nothing. Another version, ETag or size of
any file read is another digest, so a changed config.json is read again; the rest of the listing (which shards
exist) is checked against the remembered index on every pin, as :func:`~compilesvc.spec.checkpoint.checkpoint_files`
checks it on a first reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import CheckpointPin
from compilesvc.pinning.pins import ModelRefError
from compilesvc.spec.checkpoint import (
    CONFIG_NAME,
    CheckpointError,
    CheckpointMaterial,
    checkpoint_files,
    index_shards,
    weight_layout,
)
from compilesvc.spec.keys import digest

_KIND = "s3-prefix-reads"


@dataclass(frozen=True)
class Reading:
    """What the small files gave: config.json parsed and its sha256, and the shards of the index read (None when
    the layout NxDI reads is one file)."""

    config: dict[str, Any]
    config_sha256: str
    shards: list[str] | None

    def as_json(self) -> dict[str, Any]:
        return {"kind": _KIND, "config": self.config, "config_sha256": self.config_sha256, "shards": self.shards}


def small_files(names: Iterable[str], layouts: tuple[tuple[str, bool], ...]) -> list[str] | None:
    """The files a reading of a listing of ``names`` reads whole (config.json, the index the loader order picks),
    or None when the listing is refused anyway (no config.json, no weights): nothing to remember."""
    present = set(names)
    if CONFIG_NAME not in present:
        return None
    try:
        layout, is_index = weight_layout(present, layouts)
    except CheckpointError:
        return None
    return [CONFIG_NAME, layout] if is_index else [CONFIG_NAME]


def reads_key(bucket: str, objects: Mapping[str, Mapping[str, Any]], read: list[str]) -> str:
    """The digest naming a reading of files ``read`` of ``objects`` (path -> pinned entry) in ``bucket``: each
    file's key, version id, ETag and size."""
    files = [[objects[name]["key"], objects[name]["version_id"] or "", objects[name]["etag"], objects[name]["size"]]
             for name in read]
    return digest({_KIND: bucket, "files": files})


def reading_of(config: dict[str, Any], config_sha256: str, index: tuple[str, bytes] | None) -> Reading:
    """The reading to remember after a first pin: ``index`` is (name, bytes) of the index it read, if one."""
    return Reading(config, config_sha256, None if index is None else index_shards(index[1], index[0]))


def remembered(sessions: sessionmaker[Session] | None, key: str) -> Reading | None:
    if sessions is None:
        return None
    with sessions() as session:
        row = session.get(CheckpointPin, key)
        document = dict(row.material) if row is not None else None
    if document is None or document.get("kind") != _KIND:
        return None
    shards = document.get("shards")
    return Reading(dict(document["config"]), str(document["config_sha256"]),
                   None if shards is None else [str(shard) for shard in shards])


def remember(sessions: sessionmaker[Session] | None, key: str, reading: Reading) -> None:
    """Store a reading; a concurrent first pin of the same files stores the same one, and either row will do."""
    if sessions is None:
        return
    try:
        with transaction(sessions) as session:
            if session.get(CheckpointPin, key) is None:
                session.add(CheckpointPin(blob_sha256=key, material=reading.as_json()))
    except IntegrityError:
        pass


def material(reading: Reading, names: Iterable[str], weight_sha256: Callable[[str], str] | None,
             layouts: tuple[tuple[str, bool], ...]) -> tuple[CheckpointMaterial, str]:
    """What :func:`compilesvc.pinning.checkpoints.material_of` gives for this listing, from a remembered reading:
    the same weight files (the shards the index named, each still listed) and their digests when asked."""
    def unread(name: str) -> bytes:
        raise AssertionError(f"{name} is remembered, not read")

    try:
        files = checkpoint_files(names, unread, layouts, shards_of=lambda _: list(reading.shards or []))
    except CheckpointError as exc:
        raise ModelRefError(f"not a checkpoint NxD Inference can compile: {exc}") from None
    weights = None if weight_sha256 is None else {name: weight_sha256(name) for name in files}
    return CheckpointMaterial(reading.config, weights), reading.config_sha256
