"""How a webhook delivery is signed: the Standard Webhooks headers, and this service's own headers for one release.

Standard Webhooks (https://github.com/standard-webhooks/standard-webhooks, spec/standard-webhooks.md, "Signature
scheme"): ``webhook-id`` (the delivery, the same on every try), ``webhook-timestamp`` (integer Unix seconds) and
``webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``; the secret is shared in the form
``whsec_<base64 of the key>``. A receiver verifies with the project's libraries (Python: ``standardwebhooks``'s
``Webhook(secret).verify(body, headers)``).

The key: ``COMPILESVC_WEBHOOK_SECRET`` when it is a ``whsec_…`` secret is the base64 key after the prefix (give a
receiver the same string); any other secret (or the one derived from ``COMPILESVC_SECRET_KEY``) is the key's raw
bytes, and :func:`whsec` is the form a receiver takes.

Deprecated, kept for this release so receivers can move: ``Compilesvc-Webhook-Id``, ``-Timestamp`` and
``Compilesvc-Webhook-Signature: v1=<hex HMAC-SHA256 of "<timestamp>.<body>">`` under the configured secret's bytes
as before (:func:`sign`, :func:`verify`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time

STANDARD_ID, STANDARD_TIMESTAMP, STANDARD_SIGNATURE = "webhook-id", "webhook-timestamp", "webhook-signature"
SIGNATURE_HEADER = "Compilesvc-Webhook-Signature"
TIMESTAMP_HEADER = "Compilesvc-Webhook-Timestamp"
ID_HEADER = "Compilesvc-Webhook-Id"
WHSEC = "whsec_"


def standard_key(secret: bytes) -> bytes:
    """The HMAC key of the Standard Webhooks signature: a ``whsec_`` secret's base64 decoded, else the bytes."""
    if secret.startswith(WHSEC.encode()):
        try:
            return base64.b64decode(secret[len(WHSEC):], validate=True)
        except binascii.Error:
            raise ValueError("COMPILESVC_WEBHOOK_SECRET starts with whsec_ but the rest is not base64") from None
    return secret


def whsec(secret: bytes) -> str:
    """The secret as a Standard Webhooks receiver takes it."""
    return WHSEC + base64.b64encode(standard_key(secret)).decode()


def sign_standard(secret: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """``webhook-signature``'s value: ``v1,`` and the base64 HMAC-SHA256 of ``<id>.<timestamp>.<body>``."""
    content = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(standard_key(secret), content, hashlib.sha256).digest()).decode()


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The deprecated signature header's value: ``v1=`` and the hex HMAC-SHA256 of ``b"<timestamp>." + body``."""
    return "v1=" + hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def headers(secret: bytes, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Both header sets of one delivery try."""
    return {STANDARD_ID: message_id, STANDARD_TIMESTAMP: str(timestamp),
            STANDARD_SIGNATURE: sign_standard(secret, message_id, timestamp, body),
            ID_HEADER: message_id, TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: sign(secret, timestamp, body)}


def verify(secret: bytes, received: dict[str, str], body: bytes, *, tolerance: float = 300.0,
           now: float | None = None) -> bool:
    """What a receiver of the deprecated headers checks (docs/api.md): the signature, and a timestamp within
    ``tolerance`` seconds (a captured delivery cannot be replayed later)."""
    try:
        timestamp = int(received[TIMESTAMP_HEADER])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = sign(secret, timestamp, body)
    return any(hmac.compare_digest(expected, part.strip()) for part in received.get(SIGNATURE_HEADER, "").split(","))
