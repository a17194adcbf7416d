"""HMAC-signed download URLs for the local artifact store.

A :class:`compilesvc.store.local.LocalStore` cannot hand out presigned S3 URLs, so it signs
``/v1/blobs/<sha256>?expires=<unix>&sig=<hex>[&filename=<name>]`` with the service's secret key and the
API verifies the signature before streaming the file. This module owns the signed message format, the
verification (constant-time, expiry enforced) and the ``Content-Disposition`` header both stores send
for a download filename, so the API and the stores cannot drift apart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.parse

from compilesvc.store.base import SHA256_RE

#: Version tag inside the signed message: changing the format must invalidate every old URL.
_SIGNATURE_SCHEME = "compilesvc-blob-url/1"
MAX_FILENAME_LENGTH = 255


def check_filename(filename: str) -> str:
    """Return ``filename`` if it is a plain download name; ValueError otherwise.

    It ends up in a ``Content-Disposition`` header, so path separators and control characters
    (header injection, directory tricks in browsers) are refused rather than escaped.
    """
    if not filename or len(filename) > MAX_FILENAME_LENGTH:
        raise ValueError(f"download filename must be 1-{MAX_FILENAME_LENGTH} characters")
    if filename in (".", "..") or any(c in filename for c in "/\\") or any(
        ord(c) < 0x20 or ord(c) == 0x7F for c in filename
    ):
        raise ValueError(
            f"download filename {filename!r} must not contain path separators or control characters"
        )
    return filename


def _message(sha256: str, expires: int, filename: str | None) -> bytes:
    # JSON array: unambiguous field boundaries whatever characters the filename holds, and
    # None (no filename) cannot collide with any string.
    return json.dumps([_SIGNATURE_SCHEME, sha256, expires, filename], separators=(",", ":")).encode()


def sign_blob_url(secret: bytes, sha256: str, expires: int, filename: str | None) -> str:
    """The hex HMAC-SHA256 that authorises downloading ``sha256`` until ``expires`` (unix seconds)."""
    if not SHA256_RE.match(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    if filename is not None:
        check_filename(filename)
    if not secret:
        raise ValueError("the URL signing secret is empty")
    return hmac.new(secret, _message(sha256, int(expires), filename), hashlib.sha256).hexdigest()


def verify_blob_signature(
    secret: bytes,
    sha256: str,
    expires: int,
    filename: str | None,
    sig: str,
    now: float | None = None,
) -> bool:
    """True when ``sig`` was made by :func:`sign_blob_url` with ``secret`` and ``expires`` has not passed.

    Malformed input (bad digest, bad filename, non-hex signature) is simply "not valid": the caller
    answers 403 either way and must not learn which part was wrong.
    """
    current = time.time() if now is None else now
    if current > expires:
        return False
    try:
        expected = sign_blob_url(secret, sha256, expires, filename)
    except ValueError:
        return False
    return hmac.compare_digest(expected, sig.lower()) if sig.isascii() else False


def content_disposition(filename: str) -> str:
    """An ``attachment`` Content-Disposition for ``filename`` (RFC 6266: ASCII fallback plus UTF-8 form)."""
    check_filename(filename)
    fallback = "".join(c if c.isascii() and c not in '"%' else "_" for c in filename)
    encoded = urllib.parse.quote(filename, safe="")
    if fallback == filename:
        return f'attachment; filename="{filename}"'
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"
