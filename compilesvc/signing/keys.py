"""Signing keys, signed statements (DSSE envelopes in Sigstore bundles), and the trusted keys that check them.

What is signed is an in-toto Statement; how it is wrapped is the OpenSSF model-signing v1.x "key" method,
byte for byte where it matters, so its standard verifier (``model_signing verify key``) accepts our
bundles. Matched against model-signing 1.1.1:

- the statement is the DSSE payload, type ``application/vnd.in-toto+json``, signed over DSSE's
  pre-authentication encoding (``_signing/sign_sigstore_pb.py``: ``pae``; DSSE protocol v1.0);
- with ECDSA and the hash of the key's curve (``_signing/sign_ec_key.py``: ``get_ec_key_hash``);
- in a Sigstore bundle of media type ``application/vnd.dev.sigstore.bundle.v0.3+json`` whose
  ``verificationMaterial.publicKey.hint`` is the sha256 hex of the public key's PEM SubjectPublicKeyInfo
  (``sign_ec_key.py``: ``_get_verification_material``). That hint is also our **key id**.

Keys are ECDSA on NIST P-256 (P-384 and P-521 are accepted too): model-signing's key method supports only
those curves, not Ed25519. A private key file must not be readable by group or others (as ssh refuses
such a key), and its key never leaves the publishing processes (worker, relay/reaper, API).

Verifiers hold :class:`TrustedKeys`: several public keys by key id, so a rotation is "add the new public
key everywhere, switch the signing key, remove the old public key once nothing signed by it is served".
They come from ``COMPILESVC_TRUSTED_KEYS`` (PEM files or directories of them, separated by ``:``), else
from ``trusted_keys`` in the client config file. A bundle whose key id is not among them is refused;
no configured key at all is refused too, with how to configure one: a fleet never trusts a key because a
server handed it over.

This module imports only ``cryptography``, ``orjson`` and the standard library: fleets import it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from compilesvc.client import config as client_config

PAYLOAD_TYPE = "application/vnd.in-toto+json"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
TRUSTED_KEYS_ENV = "COMPILESVC_TRUSTED_KEYS"
#: The key generated in data_dir when no signing_key_file is set (its public key: ``signing-key.pub.pem``).
GENERATED_KEY_NAME = "signing-key.pem"
#: Suffixes of public key files read from a trusted-keys directory.
PUBLIC_KEY_SUFFIXES = (".pem", ".pub")
HOW_TO_TRUST = (f"set {TRUSTED_KEYS_ENV} to the service's public signing key (a PEM file, or a directory of "
                "them; several separated by ':'), or trusted_keys in the client config file; see docs/fleet.md")

_HASH_OF_CURVE: dict[str, type[hashes.HashAlgorithm]] = {
    "secp256r1": hashes.SHA256, "secp384r1": hashes.SHA384, "secp521r1": hashes.SHA512,
}


class SignatureError(Exception):
    """A signed document cannot be trusted; the message names what failed (and the key id, when known)."""

    def __init__(self, message: str, key_id: str | None = None):
        super().__init__(message)
        self.key_id = key_id


class NoTrustedKeys(SignatureError):
    """No public key is configured, so nothing can be verified."""


class UnknownKey(SignatureError):
    """Signed by a key that is not among the trusted keys."""


class BadSignature(SignatureError):
    """Not a valid bundle, or its signature does not verify, or it does not cover what it should."""


class KeyFileError(ValueError):
    """A key file that cannot be used (missing, not PEM, wrong curve, readable by others)."""


def public_pem(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id_of(key: ec.EllipticCurvePublicKey) -> str:
    """The key id: sha256 hex of the PEM SubjectPublicKeyInfo (model-signing's ``publicKey.hint``)."""
    return hashlib.sha256(public_pem(key)).hexdigest()


def _algorithm(key: ec.EllipticCurvePublicKey, where: str) -> ec.ECDSA:
    hash_type = _HASH_OF_CURVE.get(key.curve.name)
    if hash_type is None:
        raise KeyFileError(f"{where}: curve {key.curve.name} is not supported (use NIST P-256)")
    return ec.ECDSA(hash_type())


def pae(payload: bytes, payload_type: str = PAYLOAD_TYPE) -> bytes:
    """DSSE v1 pre-authentication encoding (https://github.com/secure-systems-lab/dsse, protocol.md)."""
    return b" ".join([f"DSSEv1 {len(payload_type)} {payload_type} {len(payload)}".encode(), payload])


class SigningKey:
    """A private ECDSA key that signs statements into bundles."""

    def __init__(self, private_key: ec.EllipticCurvePrivateKey, path: Path | None = None):
        self._key = private_key
        self.path = path
        self.public_key = private_key.public_key()
        self._algorithm = _algorithm(self.public_key, str(path or "the signing key"))
        self.key_id = key_id_of(self.public_key)

    @property
    def public_pem(self) -> bytes:
        return public_pem(self.public_key)

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """The key in PEM file ``path``, refused when group or others may read it."""
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except OSError as exc:
            raise KeyFileError(f"cannot read the signing key {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"the signing key {path} may be read by other users; run: chmod 600 {path}")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"{path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise KeyFileError(f"{path} is not an ECDSA key (use NIST P-256)")
        return cls(key, path)

    @classmethod
    def load_or_generate(cls, path: Path) -> SigningKey:
        """The key at ``path``, generated first (P-256, 0600, public key beside it) when there is none.
        Processes starting together end up with one key: each writes a temp file and the first link wins."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            key = ec.generate_private_key(ec.SECP256R1())
            pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(pem)
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
            finally:
                os.unlink(tmp)
        loaded = cls.load(path)
        public = public_key_path(path)
        if not public.exists() or public.read_bytes() != loaded.public_pem:
            fd, tmp = tempfile.mkstemp(prefix=f".{public.name}.", dir=path.parent)
            with os.fdopen(fd, "wb") as out:
                out.write(loaded.public_pem)
            os.chmod(tmp, 0o644)  # the public half is meant to be copied to fleets
            os.replace(tmp, public)
        return loaded

    def sign(self, statement: Mapping[str, Any]) -> bytes:
        """``statement`` as a Sigstore bundle (JSON bytes) with one DSSE signature by this key."""
        payload = orjson.dumps(statement, option=orjson.OPT_SORT_KEYS)
        signature = self._key.sign(pae(payload), self._algorithm)
        bundle = {
            "mediaType": BUNDLE_MEDIA_TYPE,
            "verificationMaterial": {"publicKey": {"hint": self.key_id}, "tlogEntries": []},
            "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                             "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}]},
        }
        return orjson.dumps(bundle, option=orjson.OPT_INDENT_2)


def public_key_path(private_key_path: Path) -> Path:
    """Where the public half of a generated key is written: ``<name>.pub.pem`` beside it."""
    return private_key_path.with_name(private_key_path.name.removesuffix(".pem") + ".pub.pem")


@dataclass(frozen=True)
class Verified:
    """A bundle that verified: the key id that signed it and the statement it carries."""

    key_id: str
    statement: dict[str, Any]


def load_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise KeyFileError(f"cannot read the trusted key {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError):
        raise KeyFileError(f"{path} is not a PEM public key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise KeyFileError(f"{path} is not an ECDSA public key")
    _algorithm(key, str(path))
    return key


class TrustedKeys:
    """The public keys a verifier accepts, by key id."""

    def __init__(self, keys: Mapping[str, ec.EllipticCurvePublicKey], source: str = ""):
        self.keys = dict(keys)
        self.source = source

    @classmethod
    def from_paths(cls, paths: Iterable[str | os.PathLike[str]], source: str = "") -> TrustedKeys:
        """Every PEM public key in ``paths``: files, or directories whose ``*.pem`` / ``*.pub`` files are."""
        keys: dict[str, ec.EllipticCurvePublicKey] = {}
        for raw in paths:
            path = Path(raw).expanduser()
            if path.is_dir():
                files = sorted(p for p in path.iterdir() if p.suffix in PUBLIC_KEY_SUFFIXES and p.is_file())
            else:
                files = [path]
            for file in files:
                key = load_public_key(file)
                keys[key_id_of(key)] = key
        return cls(keys, source)

    @classmethod
    def from_environment(cls) -> TrustedKeys:
        """``$COMPILESVC_TRUSTED_KEYS``, else ``trusted_keys`` in the client config file, else none."""
        explicit = os.environ.get(TRUSTED_KEYS_ENV, "").strip()
        if explicit:
            return cls.from_paths([p for p in explicit.split(os.pathsep) if p], TRUSTED_KEYS_ENV)
        try:
            configured = client_config.trusted_key_paths()
        except client_config.ConfigError as exc:
            raise KeyFileError(str(exc)) from None
        if configured is None:
            return cls({}, "")
        paths, where = configured
        return cls.from_paths(paths, where)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def verify(self, bundle: bytes, *, what: str) -> Verified:
        """The statement in ``bundle`` if a trusted key signed it; else :class:`SignatureError` naming
        ``what`` (e.g. "the signature of artifact <key>") and the key id."""
        if not self.keys:
            raise NoTrustedKeys(f"cannot verify {what}: no trusted public keys are configured; {HOW_TO_TRUST}")
        try:
            document = json.loads(bundle)
            if document["mediaType"] != BUNDLE_MEDIA_TYPE:
                raise ValueError(f"media type {document['mediaType']!r}")
            key_id = document["verificationMaterial"]["publicKey"]["hint"]
            if not isinstance(key_id, str) or not key_id:
                raise ValueError("no key id (verificationMaterial.publicKey.hint)")
            envelope = document["dsseEnvelope"]
            payload_type = str(envelope["payloadType"])
            payload = base64.b64decode(envelope["payload"], validate=True)
            signatures = [base64.b64decode(s["sig"], validate=True) for s in envelope["signatures"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadSignature(f"{what} is not a signature bundle this service writes ({exc!r})") from None
        key = self.keys.get(key_id)
        if key is None:
            raise UnknownKey(f"{what} is signed by key {key_id}, which is not a trusted key (trusted: "
                             f"{', '.join(sorted(self.keys))}{f' from {self.source}' if self.source else ''})",
                             key_id)
        if payload_type != PAYLOAD_TYPE or len(signatures) != 1:
            raise BadSignature(f"{what} is not a single in-toto signature", key_id)
        try:
            key.verify(signatures[0], pae(payload, payload_type), _algorithm(key, key_id))
        except InvalidSignature:
            raise BadSignature(f"{what} does not verify under key {key_id}: the signed document was changed "
                               "or the signature is not that key's", key_id) from None
        try:
            statement = json.loads(payload)
        except ValueError:
            raise BadSignature(f"{what} signs a payload that is not JSON", key_id) from None
        if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
            raise BadSignature(f"{what} does not sign an in-toto Statement v1", key_id)
        return Verified(key_id, statement)
