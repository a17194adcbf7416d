"""The checkpoint directory an NxD Inference compile reads, made by the worker before its compile child starts.

An hf-checkpoint is pinned file by file (an S3 prefix, a directory: :meth:`ModelResolver.fetch` writes the
directory, each file verified against its pin) or as an uploaded tar archive, which is fetched (sha256-checked)
and extracted here with the worker's extraction caps (:func:`workers.compiling.archive_limits.safe_extract`:
``COMPILESVC_HF_EXTRACT_*``, unsafe members refused). The child is given the directory's path, read-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compilesvc.pinning.identity import ModelResolver
from workers.compiling.archive_limits import safe_extract
from workers.compiling.contract import ExtractLimits

#: Names inside the attempt's model directory.
CHECKPOINT_DIR, ARCHIVE_NAME = "checkpoint", "checkpoint.tar"


def materialise_checkpoint(resolver: ModelResolver, fetch: dict[str, Any], model_dir: Path,
                           limits: ExtractLimits) -> Path:
    """The pinned checkpoint as a directory under ``model_dir``; returns its root (the directory holding
    config.json). Raises what :meth:`ModelResolver.fetch` raises, and
    :class:`~workers.compiling.contract.CompileFailure` for an archive past a cap or unsafe to extract (the same
    on every worker: final for the key)."""
    dest = model_dir / CHECKPOINT_DIR
    if fetch.get("kind") != "blob":
        resolver.fetch(fetch, dest)
        return dest
    archive = model_dir / ARCHIVE_NAME
    resolver.fetch(fetch, archive)
    try:
        return safe_extract(archive, dest, limits)
    finally:
        archive.unlink(missing_ok=True)  # extracted (or refused): the child reads the directory only
