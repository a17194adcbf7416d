"""What an upload request declares about its body, and reading that body so that a cut-off transfer
is an error rather than an early end.

A WSGI server hands the application a body that simply stops when the connection does: gunicorn's
Content-Length reader returns short reads at EOF, and werkzeug's wrapper (under gunicorn's
``wsgi.input_terminated``) takes a short read for the end of the stream. "The body ended" therefore
proves nothing, and each way a body can be framed gets its own check:

- **Content-Length**: the store is given it as ``expected_size`` and refuses any other count
  (:class:`compilesvc.store.SizeMismatch`). Werkzeug's development server raises
  ``ClientDisconnected`` instead, which :class:`RequestBody` reports the same way.
- **chunked**: the server's chunk parser raises when the connection ends before the last (empty)
  chunk: gunicorn ``NoMoreData`` (an ``OSError``) or ``ChunkMissingTerminator``/``InvalidChunkSize``
  (``ParseException``), werkzeug's dev server ``OSError``. :class:`RequestBody` turns each into
  :class:`BodyCutOff`.
- **a declared digest**: ``Content-Digest: sha-256=:<base64>:`` (RFC 9530), the older
  ``Digest: sha-256=<base64>`` (RFC 3230) or ``?sha256=<hex>``; :func:`declared_sha256` reads them (400
  when malformed or when they disagree) and the store is given the result as ``expected_sha256``.

Only sha-256 is verified: it is the hash the store computes anyway, and the blob's name. Digests in other
algorithms are ignored, as both RFCs allow a recipient to; the 201 answer carries the sha256, so a
client that hashed with something else can still compare. Truncation never depends on a digest.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from gunicorn.http.errors import ParseException
from http_sfv.dictionary import Dictionary
from http_sfv.item import Item
from werkzeug.exceptions import ClientDisconnected

from compilesvc.store import ContentMismatch, DigestMismatch, SizeMismatch
from web.contract.inputs import UploadHeaders, UploadQuery, invalid
from web.contract.problems import Problem

_SHA256_BYTES = 32

#: What a server's body reader raises when the connection ends (or garbles) mid-body.
_TRANSPORT_ERRORS = (ClientDisconnected, OSError, ValueError, ParseException)

class BodyCutOff(Exception):
    """The server's body reader failed after ``received`` bytes: the client went away mid-body."""

    def __init__(self, received: int):
        self.received = received
        super().__init__(f"the request body was cut off after {received} bytes")


class EmptyBody(Exception):
    """The body ended before its first byte: there is no model to store."""


class RequestBody:
    """``read()`` over the request stream that counts what arrived and reports a cut-off transfer as
    :class:`BodyCutOff` (werkzeug's 413 for a chunked body past the limit passes through), and an empty
    one as :class:`EmptyBody`, raised from ``read`` so that the store publishes nothing."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.received = 0

    def read(self, size: int = -1) -> bytes:
        try:
            data: bytes = self._stream.read(size)
        except _TRANSPORT_ERRORS as exc:
            raise BodyCutOff(self.received) from exc
        if not data and self.received == 0 and size != 0:
            raise EmptyBody()
        self.received += len(data)
        return data


def _content_digest(value: str) -> list[str]:
    field = "header Content-Digest"
    members = Dictionary()
    try:
        members.parse(value.encode("latin-1"))
    except ValueError:
        raise invalid(field, "not a structured-field dictionary; expected sha-256=:<base64>:") from None
    member = members.get("sha-256")
    if member is None:
        return []  # only algorithms this service does not verify
    digest = getattr(member, "value", None)
    if not isinstance(member, Item) or not isinstance(digest, bytes) or len(digest) != _SHA256_BYTES:
        raise invalid(field, "sha-256 must be a byte sequence of 32 bytes, :<base64>:")
    return [digest.hex()]


def _legacy_digest(value: str) -> list[str]:
    field = "header Digest"
    found: list[str] = []
    for member in value.split(","):
        if not member.strip():
            continue
        algorithm, equals, encoded = member.strip().partition("=")
        if not equals or not algorithm.strip():
            raise invalid(field, "expected <algorithm>=<value> pairs, e.g. sha-256=<base64>")
        if algorithm.strip().lower() != "sha-256":
            continue
        try:
            digest = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise invalid(field, "the sha-256 value is not base64") from None
        if len(digest) != _SHA256_BYTES:
            raise invalid(field, "the sha-256 value must decode to 32 bytes")
        found.append(digest.hex())
    return found


def declared_sha256(query: UploadQuery, headers: UploadHeaders) -> str | None:
    """The sha256 (lowercase hex) the client declared for the body, or None when it declared none.

    400 ``invalid-request`` for a malformed declaration, or for declarations that disagree with each other
    (the body cannot match both, so it is refused before a byte is read).
    """
    declared: dict[str, set[str]] = {}
    if headers.content_digest is not None:
        declared["header Content-Digest"] = set(_content_digest(headers.content_digest))
    if headers.digest is not None:
        declared["header Digest"] = set(_legacy_digest(headers.digest))
    if query.sha256 is not None:
        declared["sha256"] = {query.sha256.lower()}
    values = set().union(*declared.values()) if declared else set()
    if len(values) > 1:
        sources = sorted(name for name, found in declared.items() if found)
        raise Problem("invalid-request", "the declared sha-256 digests disagree; the body cannot match them all",
                      errors=[{"field": name, "message": "disagrees with another declared digest"}
                              for name in sources])
    return values.pop() if values else None


def refusal(exc: BodyCutOff | ContentMismatch, declared_length: int | None) -> Problem:
    """The 400 for an upload the store refused (or never saw the end of); nothing was stored."""
    if isinstance(exc, DigestMismatch):
        return Problem("digest-mismatch",
                       f"the body's sha256 is {exc.actual}, not the declared {exc.expected}; nothing was stored",
                       expected_sha256=exc.expected, actual_sha256=exc.actual)
    expected: int | None
    if isinstance(exc, SizeMismatch):
        received, expected = exc.received, exc.expected
    elif isinstance(exc, BodyCutOff):
        received, expected = exc.received, declared_length
    else:  # a ContentMismatch kind this module does not know yet: still a refusal, never a 500
        return Problem("upload-incomplete", f"{exc}; nothing was stored")
    if expected is None:
        detail = f"the chunked body ended after {received} bytes without its last chunk; nothing was stored"
    else:
        detail = f"received {received} of {expected} bytes (Content-Length); nothing was stored"
    return Problem("upload-incomplete", detail, received_bytes=received, expected_bytes=expected)


__all__ = ["BodyCutOff", "EmptyBody", "RequestBody", "declared_sha256", "refusal"]
