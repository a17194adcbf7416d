"""Caps on what an hf-dir model archive may expand to: total bytes, member count and compression ratio.

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
from pathlib import Path

from workers.compiling.contract import CompileFailure, ExtractLimits

#: Below this many extracted bytes the ratio is not checked: a small archive cannot hurt, and a tiny test
#: model of zeros or a config-only directory compresses far better than real weights.
RATIO_FLOOR_BYTES = 64 * 1024**2

#: The codes, one per cap (documented in docs/security.md, "Extraction caps").
TOO_LARGE = "HF_DIR_TOO_LARGE"
TOO_MANY_FILES = "HF_DIR_TOO_MANY_FILES"
RATIO = "HF_DIR_COMPRESSION_RATIO"


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
