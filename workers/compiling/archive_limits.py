"""Caps on what an hf-dir model archive may expand to: total bytes, member count and compression ratio; and its
safe extraction (:func:`safe_extract`, torch-free: the worker extracts hf-checkpoint archives itself).

Owns :class:`ArchiveLimitExceeded` (a compile error of its own code per cap) and :func:`check_archive`, which
reads the archive's headers, not its contents, and stops at the first header past a cap: an archive that
would fill the disk is refused before a byte of it is written, and a gzip bomb is not even decompressed
past the member that trips the cap. The caps themselves (:class:`workers.compiling.contract.ExtractLimits`) are
worker settings (``COMPILESVC_HF_EXTRACT_*``) that the runner puts in the child's request.

Why a compile error, not an infrastructure one: the archive is part of the pinned model, so every worker
would find the same sizes in the same headers. Retrying it (as a full disk is retried) could only fill
another worker's disk.
"""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

from compilesvc.spec.checkpoint import CheckpointError, add_member, archive_member_path
from compilesvc.store.tar_caps import ArchiveHeaderTooLarge, open_capped
from workers.compiling.contract import CompileFailure, ExtractLimits

#: Below this many extracted bytes the ratio is not checked: a small archive cannot hurt, and a tiny test
#: model of zeros or a config-only directory compresses far better than real weights.
RATIO_FLOOR_BYTES = 64 * 1024**2

DEFAULT_EXTRACT_LIMITS = ExtractLimits()

#: The codes, one per cap (documented in docs/security.md, "Extraction caps").
TOO_LARGE = "HF_DIR_TOO_LARGE"
TOO_MANY_FILES = "HF_DIR_TOO_MANY_FILES"
RATIO = "HF_DIR_COMPRESSION_RATIO"
#: An extension header (pax, GNU long name, sparse map) past a cap of :mod:`compilesvc.store.tar_caps`.
HEADER_TOO_LARGE = "HF_DIR_HEADER_TOO_LARGE"


class ArchiveLimitExceeded(CompileFailure):
    """The hf-dir archive would expand past one of the worker's caps: final for the key, like any compile
    error (the bytes are the model's), and never extracted."""


def _mib(size: float) -> str:
    return f"{size / 1024**2:.1f} MiB"


def check_archive(tar: tarfile.TarFile, archive: Path, limits: ExtractLimits) -> list[tarfile.TarInfo]:
    """The members of ``tar`` (opened on ``archive``), read lazily; raises :class:`ArchiveLimitExceeded`
    at the first header that takes the total past a cap. The sizes are the headers' own, which tarfile
    honours when extracting (it writes exactly ``size`` bytes per member)."""
    packed = max(archive.stat().st_size, 1)
    ratio_bound = max(RATIO_FLOOR_BYTES, limits.max_ratio * packed)
    members: list[tarfile.TarInfo] = []
    total = 0
    for member in tar:
        members.append(member)
        if len(members) > limits.max_files:
            raise ArchiveLimitExceeded(
                TOO_MANY_FILES, f"the hf-dir archive has more than {limits.max_files} members, this worker's cap "
                                "(COMPILESVC_HF_EXTRACT_MAX_FILES); nothing was extracted")
        if member.isfile():
            total += member.size
        if total > limits.max_bytes:
            raise ArchiveLimitExceeded(
                TOO_LARGE, f"the hf-dir archive expands to more than {_mib(limits.max_bytes)} (at least "
                           f"{_mib(total)} by member {member.name!r}), this worker's cap "
                           "(COMPILESVC_HF_EXTRACT_MAX_BYTES); nothing was extracted")
        if total > ratio_bound:
            raise ArchiveLimitExceeded(
                RATIO, f"the hf-dir archive of {_mib(packed)} expands to more than {limits.max_ratio:g} times "
                       f"its size (at least {_mib(total)} by member {member.name!r}), this worker's cap "
                       "(COMPILESVC_HF_EXTRACT_MAX_RATIO); nothing was extracted")
    return members


def safe_extract(archive: Path, dest: Path, limits: ExtractLimits = DEFAULT_EXTRACT_LIMITS, *,
                 checkpoint: bool = False) -> Path:
    """Extract a .tar/.tar.gz of a Hugging Face model directory into ``dest``; return the model root.

    Members with absolute names or ``..`` components are refused outright; extraction then uses tarfile's
    ``data`` filter (Python >= 3.11.4), which also refuses links leaving ``dest`` and device files and
    sanitises permission bits. An archive past one of ``limits`` (total bytes, members, ratio) is
    refused before anything is written (:mod:`workers.compiling.archive_limits`). The root is ``dest`` or its
    single top-level directory, whichever holds ``config.json``.

    ``checkpoint`` (an hf-checkpoint archive, keyed by the config.json and weights pinning read out of it): links
    (symbolic or hard, even inside ``dest``), devices and a second member of one normalised path are refused too,
    by the rule pinning applies (:func:`compilesvc.spec.checkpoint.archive_member_path`), so the files extracted
    are the files the key was made from; code ``HF_DIR_UNSAFE_ARCHIVE``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with open_capped(archive) as tar:
            members = check_archive(tar, archive, limits)
            for member in members:
                # The data filter would strip a leading "/" and extract inside dest; a model archive with
                # absolute or parent-relative names is malformed or hostile either way, so refuse it.
                if member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
                    raise tarfile.FilterError(f"member {member.name!r} points outside the archive root")
            if checkpoint:
                _check_checkpoint_members(members)
            tar.extractall(dest, members=members, filter="data")
    except ArchiveHeaderTooLarge as exc:  # refused before tarfile read the header's payload
        raise ArchiveLimitExceeded(HEADER_TOO_LARGE, f"the hf-dir archive is refused: {exc} (archive header cap: "
                                                     f"{exc.cap}); nothing was extracted") from exc
    except (tarfile.FilterError, CheckpointError) as exc:
        raise CompileFailure("HF_DIR_UNSAFE_ARCHIVE", f"refusing to extract the model archive: {exc}") from exc
    except (tarfile.ReadError, tarfile.CompressionError, EOFError) as exc:
        raise CompileFailure("MODEL_LOAD_ERROR", f"hf-dir model is not a readable tar archive: {exc}") from exc
    if (dest / "config.json").is_file():
        return dest
    entries = [p for p in dest.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and (entries[0] / "config.json").is_file():
        return entries[0]
    raise CompileFailure("HF_DIR_NO_CONFIG", "hf-dir archive has no config.json at its root or in its single "
                                             "top-level directory")


def _check_checkpoint_members(members: list[tarfile.TarInfo]) -> None:
    """CheckpointError at the first member of an hf-checkpoint archive pinning would have refused."""
    seen: set[str] = set()
    for member in members:
        path = archive_member_path(member.name, regular=member.isfile(), directory=member.isdir())
        if path is not None:
            add_member(seen, path, member.name)
