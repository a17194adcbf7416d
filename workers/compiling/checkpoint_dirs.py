"""The checkpoint directory an NxD Inference compile reads, made by the worker before its compile child starts.

An hf-checkpoint is pinned file by file (an S3 prefix, a directory: :meth:`ModelResolver.fetch` writes the
directory, each file verified against its pin) or as an uploaded tar archive, which is fetched (sha256-checked)
and extracted here with the worker's extraction caps (:func:`workers.compiling.archive_limits.safe_extract`:
``COMPILESVC_HF_EXTRACT_*``, unsafe members, links and duplicate paths refused). Before the child is given the
directory's path (read-only), the files the key was made from (config.json, and the weight files when the key holds
them: the pin's ``verify``) are hashed again there: a compile never reads other bytes than its key names.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from compilesvc.pinning.checkpoints import safe_relative
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelChangedError
from compilesvc.store.hashing import CHUNK_SIZE
from workers.compiling.archive_limits import safe_extract
from workers.compiling.contract import ExtractLimits

#: Names inside the attempt's model directory.
CHECKPOINT_DIR, ARCHIVE_NAME = "checkpoint", "checkpoint.tar"


def materialise_checkpoint(resolver: ModelResolver, fetch: dict[str, Any], model_dir: Path,
                           limits: ExtractLimits) -> Path:
    """The pinned checkpoint as a directory under ``model_dir``; returns its root (the directory holding
    config.json). Raises what :meth:`ModelResolver.fetch` raises, and
    :class:`~workers.compiling.contract.CompileFailure` for an archive past a cap or unsafe to extract (the same
    on every worker: final for the key). :class:`ModelChangedError` when a file the key was made from is not, in
    the directory, the bytes pinned (:func:`verify_checkpoint`)."""
    dest = model_dir / CHECKPOINT_DIR
    if fetch.get("kind") != "blob":
        resolver.fetch(fetch, dest)
        root = dest
    else:
        archive = model_dir / ARCHIVE_NAME
        resolver.fetch(fetch, archive)
        try:
            root = safe_extract(archive, dest, limits, checkpoint=True)
        finally:
            archive.unlink(missing_ok=True)  # extracted (or refused): the child reads the directory only
    verify_checkpoint(root, fetch.get("verify") or {})
    return root


def verify_checkpoint(root: Path, expected: dict[str, str]) -> None:
    """Each ``{relative path: sha256}`` of ``expected`` is a regular file (not a link) under ``root`` with that
    sha256; else :class:`ModelChangedError` naming the file (the compile would read other bytes than the key's)."""
    for name, sha256 in sorted(expected.items()):
        path = root / safe_relative(name, "model.uri")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ModelChangedError(f"{name} is missing from the checkpoint directory the compile would read; "
                                    "it is not the checkpoint pinned at submit") from None
        if not stat.S_ISREG(st.st_mode):
            raise ModelChangedError(f"{name} in the checkpoint directory is not a regular file; it is not the "
                                    "checkpoint pinned at submit")
        hasher = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK_SIZE):
                hasher.update(chunk)
        if hasher.hexdigest() != sha256:
            raise ModelChangedError(f"{name} in the checkpoint directory has sha256 {hasher.hexdigest()}, not the "
                                    f"{sha256} pinned at submit (the key's); resubmit the build to pin it again")
