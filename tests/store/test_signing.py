"""Signed local-store URLs: what is signed, expiry, tampering, and the LocalStore URL shape."""

from __future__ import annotations

import hashlib
import urllib.parse
from pathlib import Path

import pytest

from compilesvc.store import LocalStore
from compilesvc.store.signing import (
    check_filename,
    content_disposition,
    sign_blob_url,
    verify_blob_signature,
)

SECRET = b"s" * 32
SHA = hashlib.sha256(b"x").hexdigest()


def test_sign_and_verify() -> None:
    sig = sign_blob_url(SECRET, SHA, 2000, "model.neff")
    assert verify_blob_signature(SECRET, SHA, 2000, "model.neff", sig, now=1999)
    assert verify_blob_signature(SECRET, SHA, 2000, "model.neff", sig.upper(), now=1999)
    assert not verify_blob_signature(SECRET, SHA, 2000, "model.neff", sig, now=2001)  # expired
    assert not verify_blob_signature(SECRET, SHA, 2001, "model.neff", sig, now=1999)  # expiry extended
    assert not verify_blob_signature(SECRET, SHA, 2000, "other.neff", sig, now=1999)  # filename swapped
    assert not verify_blob_signature(SECRET, SHA, 2000, None, sig, now=1999)  # filename dropped
    assert not verify_blob_signature(SECRET, "0" * 64, 2000, "model.neff", sig, now=1999)  # other blob
    assert not verify_blob_signature(b"t" * 32, SHA, 2000, "model.neff", sig, now=1999)  # other key
    for junk in ("", "zz", "é" * 64, sig[:-1]):
        assert not verify_blob_signature(SECRET, SHA, 2000, "model.neff", junk, now=1999)
    assert not verify_blob_signature(SECRET, "not-a-sha", 2000, None, sig, now=1999)


def test_filenames_are_plain_names() -> None:
    for bad in ("", "a/b", "..", "a\\b", "x\ny", "x\r\nSet-Cookie: a=b", "a" * 256):
        with pytest.raises(ValueError):
            check_filename(bad)
        with pytest.raises(ValueError):
            sign_blob_url(SECRET, SHA, 1, bad)
    assert content_disposition("model.neff") == 'attachment; filename="model.neff"'
    assert content_disposition('we"ird é.pt2') == (
        "attachment; filename=\"we_ird _.pt2\"; filename*=UTF-8''we%22ird%20%C3%A9.pt2"
    )


def test_local_store_url_shape(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, public_url="https://compile.example/", secret_key=SECRET)
    url = store.blob_url(SHA, expires_in=60, filename="bucket 1.neff")
    parsed = urllib.parse.urlsplit(url)
    assert f"{parsed.scheme}://{parsed.netloc}{parsed.path}" == f"https://compile.example/v1/blobs/{SHA}"
    query = dict(urllib.parse.parse_qsl(parsed.query))
    assert set(query) == {"expires", "sig", "filename"} and query["filename"] == "bucket 1.neff"
    assert verify_blob_signature(SECRET, SHA, int(query["expires"]), query["filename"], query["sig"])
    assert not verify_blob_signature(SECRET, SHA, int(query["expires"]), query["filename"], query["sig"],
                                     now=int(query["expires"]) + 1)
    with pytest.raises(ValueError):
        store.blob_url(SHA, expires_in=0)
    with pytest.raises(ValueError):
        store.blob_url("nothex", expires_in=60)


def test_local_store_refuses_escaping_document_names(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", public_url="http://x", secret_key=SECRET)
    for bad in ("../escape.json", "/abs.json", "a/../../b", "blobs/sha256/aa/x", "tmp/x", "", "a//b"):
        with pytest.raises(ValueError):
            store.create_document(bad, b"{}")
    assert not (tmp_path / "escape.json").exists()
    with pytest.raises(ValueError):
        LocalStore(tmp_path / "s2", public_url="http://x", secret_key=b"")
