"""One file downloaded from an expiring URL into a partial file: resumed with an HTTP range where an
earlier attempt (or a killed process) left bytes, hashed while streaming, and accepted only at its exact
size and sha256.

Both stores answer ranges: S3 (a presigned GET signs the host only, so a ``Range`` header may be added)
and the local store's signed ``/v1/blobs`` route. A server that ignores the range (200 instead of 206) or
a ``Content-Range`` that does not start where the partial file ends makes the download start over: bytes
are only ever appended at the offset the server confirmed.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from compilesvc.client.api import DOWNLOADS, backoff
from compilesvc.spec.manifest import FileEntry

CHUNK = 1024 * 1024
RETRIES = 5  # transport failures per file, each resuming where the last stopped
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class DownloadError(Exception):
    """A file could not be downloaded whole and verified; nothing of it was installed."""


class ContentDiffers(DownloadError):
    """The bytes served are not the (signed) manifest's: another size or sha256."""


class UrlExpired(DownloadError):
    """The URL was refused (403): it expired or its signature no longer holds; fetch a fresh one."""


@dataclass
class Transfer:
    """What one download moved over the network, for the summary and for tests of resumption."""

    received: int = 0
    resumed_from: int = 0


def download(url: Callable[[bool], str], partial: Path, entry: FileEntry, *,
             progress: Callable[[int], None] = lambda n: None, timeout: float = 60.0) -> Transfer:
    """Fill ``partial`` with ``entry``'s bytes, verified; the caller renames it into place.

    ``url(refresh)`` gives the download URL (a fresh one when ``refresh``: the first one expired).
    ``progress`` is called with the byte count of every chunk received, and once with the bytes a resumed
    partial file already held.
    """
    transfer = Transfer()
    link = url(False)
    refreshed = False
    started_over = False
    failures = 0
    digest, have = _prefix(partial, entry.size)
    transfer.resumed_from = have
    progress(have)
    while True:
        if have == entry.size:
            if digest.hexdigest() == entry.sha256:
                return transfer
            # A resumed prefix can be wrong (a file left by something else): one clean start, then fail.
            if started_over or transfer.resumed_from == 0:
                partial.unlink(missing_ok=True)
                raise ContentDiffers(f"{entry.path}: the download's sha256 is {digest.hexdigest()}, the manifest "
                                    f"says {entry.sha256}; nothing was installed")
            progress(-have)
            digest, have, started_over = _restart(partial)
            continue
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            request = urllib.request.Request(link, headers=headers)
            with DOWNLOADS.open(request, timeout=timeout) as response:
                if have and not _continues(response.status, response.headers.get("Content-Range"), have):
                    progress(-have)
                    digest, have, started_over = _restart(partial)
                    if response.status != 200:
                        continue  # a range we did not ask for: ask again from zero
                with open(partial, "ab") as out:
                    while chunk := response.read(CHUNK):
                        if have + len(chunk) > entry.size:
                            partial.unlink(missing_ok=True)
                            raise ContentDiffers(f"{entry.path}: the server sent more than the manifest's "
                                                f"{entry.size} bytes; nothing was installed")
                        out.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
                        transfer.received += len(chunk)
                        progress(len(chunk))
                    out.flush()
                    os.fsync(out.fileno())
            if have < entry.size:
                raise ConnectionError(f"the response ended at byte {have} of {entry.size}")
        except urllib.error.HTTPError as exc:
            if exc.code == 416:  # the partial file is not a prefix the server can continue
                progress(-have)
                digest, have, started_over = _restart(partial)
                continue
            if exc.code == 403 and not refreshed:
                refreshed = True
                link = url(True)
                continue
            if exc.code in (429, 500, 502, 503, 504) and failures < RETRIES:
                time.sleep(backoff(failures))
                failures += 1
                continue
            raise DownloadError(f"{entry.path}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if failures >= RETRIES:
                raise DownloadError(f"{entry.path}: {getattr(exc, 'reason', exc)} (after {failures} retries; "
                                    f"the {have} bytes received are kept for the next try)") from None
            time.sleep(backoff(failures))
            failures += 1


def _continues(status: int, content_range: str | None, offset: int) -> bool:
    """A response to ``Range: bytes=<offset>-`` that continues exactly at ``offset``."""
    if status != 206 or not content_range:
        return False
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    return match is not None and int(match.group(1)) == offset


def _prefix(partial: Path, size: int) -> tuple[hashlib._Hash, int]:
    """The sha256 state and length of what an earlier attempt left in ``partial`` (nothing if it is longer
    than the file can be)."""
    digest = hashlib.sha256()
    have = 0
    try:
        with open(partial, "rb") as f:
            if os.fstat(f.fileno()).st_size <= size:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    have += len(chunk)
                return digest, have
    except FileNotFoundError:
        pass
    digest, have, _ = _restart(partial)
    return digest, have


def _restart(partial: Path) -> tuple[hashlib._Hash, int, bool]:
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    os.close(fd)
    return hashlib.sha256(), 0, True
