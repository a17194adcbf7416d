"""Caps on a tar archive's extension headers, applied before ``tarfile`` reads their payload: the one place the API
(checkpoint pinning, :mod:`compilesvc.pinning.checkpoints`) and the worker (extraction,
:mod:`workers.compiling.archive_limits`) bound what an archive's headers can make a process allocate.

Why: a header block declares the size of the payload after it, and CPython's ``tarfile`` reads that payload whole
(``tarfile.fileobj.read(self._block(self.size))``) before anything else looks at it, for GNU longname/longlink
(``TarInfo._proc_gnulong``, Lib/tarfile.py line 1347 in 3.11.7) and pax headers (``TarInfo._proc_pax``, line 1403);
a GNU sparse header reads one block per extension while the previous one says more follow (``_proc_sparse``, lines
1377-1390), and a pax GNU sparse 1.0 map is read block by block up to a count it declares (``_proc_gnusparse_10``,
lines 1519-1533). A 1 MB gzip of a pax header declaring 1 GiB of zeros made an API process allocate 1 GiB. The
per-member caps the callers apply (member count, total size) see members, never these headers.

:class:`CappedTarInfo` is the ``tarinfo`` class a ``TarFile`` is opened with (:func:`open_capped`): each extension
header's declared size is checked against its cap when its 512-byte block is parsed, before the payload is read;
the extension headers in front of one member are bounded in number (each pax header reads the next header
recursively) and in total size across the archive. Sparse members are refused outright: a model checkpoint has no
holes, and a sparse map only lets a small archive declare a large expansion. A header past a cap raises
:class:`ArchiveHeaderTooLarge` (a ``tarfile.TarError`` that is no ``HeaderError``, so ``TarFile.next`` does not turn
it into a quiet end of the archive), naming the cap.
"""

from __future__ import annotations

import os
import tarfile
from typing import IO

#: The most one GNU longname or longlink payload may declare: far past any path (Linux PATH_MAX is 4096).
MAX_LONG_NAME_BYTES = 64 * 1024
#: The most one pax header payload may declare (paths, times, a few attributes: real ones are under a KiB).
MAX_PAX_HEADER_BYTES = 1024 * 1024
#: The most all extension headers of one archive may declare together.
MAX_HEADER_BYTES_TOTAL = 8 * 1024 * 1024
#: The most extension headers in front of one member (tar writes at most a pax header and a longname/longlink).
MAX_CHAINED_HEADERS = 8

_LONG_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


class ArchiveHeaderTooLarge(tarfile.TarError):
    """An extension header past one of this module's caps; ``cap`` names it (``pax-header``, ``long-name``,
    ``headers-total``, ``chained-headers``, ``sparse``)."""

    def __init__(self, cap: str, message: str):
        super().__init__(message)
        self.cap = cap


def _mib(size: int) -> str:
    return f"{size / 1024**2:g} MiB" if size >= 1024**2 else f"{size // 1024} KiB"


class CappedTarInfo(tarfile.TarInfo):
    """A ``TarInfo`` whose extension headers are checked against the caps before ``tarfile`` reads their payload.

    ``_proc_member`` is the documented hook (Lib/tarfile.py line 1299: "can be overridden in a subclass"); the
    payload reads are in the methods it dispatches to, so checking here comes first."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise ArchiveHeaderTooLarge("sparse", f"member {self.name!r} is a GNU sparse file; sparse members are "
                                                  "refused (a checkpoint has no holes)")
        if self.type in _LONG_TYPES or self.type in _PAX_TYPES:
            _charge(tarfile_, self)
        else:
            # A member's own header: the chain of extension headers in front of it is over.
            tarfile_._capped_chain = 0  # type: ignore[attr-defined]
        return super()._proc_member(tarfile_)  # type: ignore[misc,no-any-return]

    def _proc_gnusparse_10(self, next: tarfile.TarInfo, pax_headers: dict[str, str],
                           tarfile_: tarfile.TarFile) -> None:
        raise ArchiveHeaderTooLarge("sparse", f"member {next.name!r} is a pax GNU sparse file; sparse members are "
                                              "refused (a checkpoint has no holes)")

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        # GNU sparse 0.0/0.1 maps come in the pax payload itself (already bounded by its cap); the member they
        # describe is refused like any sparse one.
        if any(key.startswith("GNU.sparse.") for key in pax_headers):
            raise ArchiveHeaderTooLarge("sparse", f"member {self.name!r} is a pax GNU sparse file; sparse members "
                                                  "are refused (a checkpoint has no holes)")
        super()._apply_pax_info(pax_headers, encoding, errors)  # type: ignore[misc]


def _charge(tar: tarfile.TarFile, header: tarfile.TarInfo) -> None:
    """Count an extension header against the archive's caps, before its payload of ``header.size`` is read."""
    is_pax = header.type in _PAX_TYPES
    kind, cap = ("pax header", MAX_PAX_HEADER_BYTES) if is_pax else ("GNU long name", MAX_LONG_NAME_BYTES)
    if header.size > cap:
        raise ArchiveHeaderTooLarge(
            "pax-header" if is_pax else "long-name",
            f"the archive's {kind} at offset {header.offset} declares {header.size} bytes, more than the "
            f"{_mib(cap)} an archive's {kind} may hold")
    total = getattr(tar, "_capped_total", 0) + header.size
    chain = getattr(tar, "_capped_chain", 0) + 1
    if total > MAX_HEADER_BYTES_TOTAL:
        raise ArchiveHeaderTooLarge(
            "headers-total", f"the archive's extension headers declare more than {_mib(MAX_HEADER_BYTES_TOTAL)} "
                             f"together (at offset {header.offset}), the most an archive's headers may hold")
    if chain > MAX_CHAINED_HEADERS:
        raise ArchiveHeaderTooLarge(
            "chained-headers", f"more than {MAX_CHAINED_HEADERS} extension headers in front of one member (at "
                               f"offset {header.offset})")
    tar._capped_total = total  # type: ignore[attr-defined]
    tar._capped_chain = chain  # type: ignore[attr-defined]


def open_capped(name: str | os.PathLike[str] | None = None, mode: str = "r",
                fileobj: IO[bytes] | None = None) -> tarfile.TarFile:
    """``tarfile.open`` for reading (``mode`` one of its ``r`` modes), its headers under this module's caps."""
    if not mode.startswith("r"):
        raise ValueError(f"open_capped reads archives; mode {mode!r} is not a read mode")
    return tarfile.open(name, mode, fileobj, tarinfo=CappedTarInfo)  # type: ignore[call-overload,no-any-return]
