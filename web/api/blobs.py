"""Model uploads (``POST /v1/models``) and local-store downloads (``GET /v1/blobs/{sha256}``).

Uploads stream: the request body goes straight to :meth:`ArtifactStore.put_stream`, which hashes while
it writes, so an 8 GiB model never sits in memory. The limit is ``max_upload_bytes`` (not the general
``max_request_bytes``): a declared Content-Length over it is refused before a byte is read, and a
chunked body is cut off as soon as it passes it. Uploads are all or nothing: the store publishes the
blob only if the body arrived whole and matches any digest the client declared (:mod:`web.uploads`).

Downloads exist only for the local store (S3 hands out presigned URLs): the URL's HMAC signature and
expiry are checked by :func:`compilesvc.store.signing.verify_blob_signature`, then the file is streamed
(with Range support) from the store's directory.
"""

from __future__ import annotations

import time
from typing import BinaryIO, cast

from flask import Blueprint, Response, request, send_file
from werkzeug.exceptions import RequestEntityTooLarge

from compilesvc.access.tokens import Permission
from compilesvc.store.base import BlobTooLarge, ContentMismatch
from compilesvc.store.local import LocalStore
from compilesvc.store.signing import content_disposition, verify_blob_signature
from web.api.params import respond
from web.auth import current_principal
from web.context import web
from web.contract.access import SIGNED_URL
from web.contract.inputs import BlobQuery, UploadHeaders, UploadQuery
from web.contract.openapi import operation
from web.contract.problems import Problem
from web.contract.schemas import UploadOut
from web.readers import reader
from web.uploads import BodyCutOff, EmptyBody, RequestBody, declared_sha256, refusal

bp = Blueprint("blobs", __name__, url_prefix="/v1")

UPLOAD_ENDPOINT = "blobs.upload_model"


@bp.post("/models")
@operation(summary="Upload a model (raw body, streamed)", tag="models", access=Permission.SUBMIT,
           description="Send the model file as the raw request body (application/octet-stream, Content-Length "
                       "or chunked). Form uploads (multipart/form-data, application/x-www-form-urlencoded) are "
                       "refused with 415. Use the returned `uri` as the spec's `model.uri`. All or nothing: a "
                       "body cut off before its Content-Length or last chunk, or not matching a declared digest, "
                       "is refused with 400 and nothing is stored.",
           request_media="application/octet-stream",
           request_schema={"type": "string", "contentMediaType": "application/octet-stream", "minLength": 1},
           query=UploadQuery, headers=UploadHeaders,
           responses={201: UploadOut}, problems=(400, 413, 415, 503))
def upload_model(query: UploadQuery, headers: UploadHeaders) -> Response:
    refuse_form_upload()
    ctx = web()
    principal = current_principal()
    submit_limit, admin_limit = ctx.settings.upload_limits
    limit = admin_limit if principal is not None and principal.is_admin else submit_limit
    too_large = Problem("upload-too-large", f"model uploads of this token are limited to {limit} bytes",
                        max_bytes=limit)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large  # refuse before reading a byte
    empty = Problem("invalid-request", "the body is empty; send the model file as the request body",
                    errors=[{"field": "body", "message": "empty"}])
    if declared == 0:
        raise empty
    expected_sha256 = declared_sha256(query, headers)  # a malformed digest is refused before a byte is read
    # One byte of headroom: the store sees the oversize and raises BlobTooLarge itself (it cleans up).
    request.max_content_length = limit + 1
    try:
        info = ctx.services.store.put_stream(cast(BinaryIO, RequestBody(request.stream)), max_bytes=limit,
                                             expected_size=declared, expected_sha256=expected_sha256)
    except (BlobTooLarge, RequestEntityTooLarge):
        raise too_large from None
    except (BodyCutOff, ContentMismatch) as exc:
        raise refusal(exc, declared) from None
    except EmptyBody:  # a chunked body of no chunks: refused before anything was stored
        raise empty from None
    # Under the team boundary, whether the store held these bytes already (another team's upload) is not this
    # token's to learn: every upload answers as a first one.
    created = info.created or reader().bounded
    return respond(UploadOut, {"uri": f"blob:sha256:{info.sha256}", "sha256": info.sha256, "size": info.size,
                          "created": created}, 201)


#: Bodies that are an envelope or an encoding around the file, never the file: storing one would store the
#: form (boundaries, field headers; or curl -d's mangled bytes) as the model.
RAW = "application/octet-stream"
FORM_TYPES = ("multipart/", "application/x-www-form-urlencoded")
UPLOAD_HINT = "curl --data-binary @model.pt -H 'Content-Type: application/octet-stream'"


def refuse_form_upload() -> None:
    """415 for anything but a raw body, before a byte of the body is read (so nothing is stored).

    The body is stored as the model's bytes exactly as received, so only a body that says it is raw bytes
    (``application/octet-stream``) is taken: a form (``curl -F``; also ``curl --data-binary`` without
    ``-H``, which labels the body a urlencoded form) would be stored envelope and all, and another type
    (``text/plain``, ``application/json``) may have been transformed on its way. A body with no
    Content-Type at all is raw bytes by definition (RFC 9110, 8.3: a recipient may assume
    ``application/octet-stream``), which is what ``requests.post(url, data=f)`` sends.
    """
    mimetype = request.mimetype  # lower-cased, parameters (boundary=, charset=) stripped
    if not mimetype or mimetype == RAW:
        return
    what = "a form, not a model file" if mimetype.startswith(FORM_TYPES) else "not a raw model file"
    raise Problem("unsupported-media-type",
                  f"{mimetype} is {what}; send the file itself as the body, as {RAW}: {UPLOAD_HINT}",
                  headers={"Accept-Post": RAW}, hint=UPLOAD_HINT)


@bp.get("/blobs/<sha256:sha256>")
@operation(summary="Download a blob through a signed URL (local store only)", tag="artifacts", access=SIGNED_URL,
           description="The URLs come from artifact manifests; they expire. 403 when the signature is wrong "
                       "or expired.",
           query=BlobQuery, invalid_query="signature-invalid",
           responses={200: "application/octet-stream"}, problems=(403, 404))
def download_blob(sha256: str, query: BlobQuery) -> Response:
    ctx = web()
    store = ctx.services.store
    if not isinstance(store, LocalStore):
        raise Problem("blob-not-found", "this service keeps blobs in S3; use the URLs in the artifact manifest")
    expires, filename = query.expires, query.filename
    if not verify_blob_signature(ctx.settings.resolved_secret_key, sha256, expires, filename, query.sig):
        raise Problem("signature-invalid", "the download URL is invalid or has expired")
    path = store.local_blob_path(sha256)
    if not path.is_file():
        raise Problem("blob-not-found", f"blob {sha256} is not in the store")
    response = send_file(path, mimetype="application/octet-stream", conditional=True, etag=sha256,
                         max_age=max(0, min(expires - int(time.time()), 86400)))
    if filename:
        response.headers["Content-Disposition"] = content_disposition(filename)
    # The content never changes for a name; only the URL expires.
    response.cache_control.private = True
    response.cache_control.immutable = True
    return response
