"""Signing keys and bundles (compilesvc/signing/keys.py), the artifact statement (compilesvc/signing/artifacts.py)
checked by the OpenSSF verifier's own code, and what the fleet side imports."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from compilesvc.signing.artifacts import (
    ArtifactSigner,
    provenance_statement,
    signature_statement,
    verify_artifact,
    verify_provenance,
)
from compilesvc.signing.keys import (
    BadSignature,
    KeyFileError,
    NoTrustedKeys,
    SigningKey,
    TrustedKeys,
    UnknownKey,
    public_key_path,
)
from compilesvc.spec.keys import artifact_key_of, bucket_key_of
from compilesvc.spec.manifest import ArtifactBucketEntry, ArtifactManifest, FileEntry


def manifest_of(files: dict[str, bytes], model: str = "cd" * 32) -> ArtifactManifest:
    material = {"schema": "compilesvc-key/3", "model": {"sha256": model, "format": "torchscript"}}
    inputs = [{"name": "x", "shape": [1, 4], "dtype": "float32"}]
    bucket_key = bucket_key_of(material, inputs)
    entries = [FileEntry(path=name, role="model" if name == "model.pt" else "aux", size=len(data),
                         sha256=hashlib.sha256(data).hexdigest()) for name, data in files.items()]
    log = FileEntry(path="compile.log", role="log", size=3, sha256="ab" * 32)
    return ArtifactManifest(key=artifact_key_of(material, [bucket_key]), material=material,
                            components={"model": "cd" * 32},
                            buckets=[ArtifactBucketEntry(key=bucket_key, position=0, inputs=inputs,
                                                         manifest=f"buckets/{bucket_key}/manifest.json",
                                                         files=entries, log=log)],
                            size_bytes=sum(e.size for e in entries), created_at="2026-01-01T00:00:00+00:00")


def test_a_generated_key_is_private_and_its_public_half_is_beside_it(tmp_path: Path) -> None:
    key = SigningKey.load_or_generate(tmp_path / "keys" / "signing-key.pem")
    assert (tmp_path / "keys" / "signing-key.pem").stat().st_mode & 0o777 == 0o600
    public = public_key_path(tmp_path / "keys" / "signing-key.pem")
    assert public.name == "signing-key.pub.pem" and public.read_bytes() == key.public_pem
    assert SigningKey.load_or_generate(tmp_path / "keys" / "signing-key.pem").key_id == key.key_id  # kept


def test_unusable_key_files_are_refused(tmp_path: Path) -> None:
    SigningKey.load_or_generate(tmp_path / "k.pem")
    os.chmod(tmp_path / "k.pem", 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        SigningKey.load(tmp_path / "k.pem")
    edwards = tmp_path / "ed.pem"
    edwards.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(edwards, 0o600)
    with pytest.raises(KeyFileError, match="not an ECDSA key"):
        SigningKey.load(edwards)
    with pytest.raises(KeyFileError, match="cannot read"):
        SigningKey.load(tmp_path / "missing.pem")
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        TrustedKeys.from_paths([tmp_path / "k.pem"])  # a private key is not a trusted key


def test_bundles_verify_only_unchanged_and_only_under_a_trusted_key(tmp_path: Path) -> None:
    key = SigningKey.load_or_generate(tmp_path / "a.pem")
    other = SigningKey.load_or_generate(tmp_path / "b.pem")
    statement = {"_type": "https://in-toto.io/Statement/v1", "subject": [], "predicateType": "t", "predicate": {}}
    bundle = key.sign(statement)
    trusted = TrustedKeys.from_paths([public_key_path(tmp_path / "a.pem")])
    assert trusted.verify(bundle, what="it").statement == statement
    with pytest.raises(UnknownKey) as unknown:
        TrustedKeys.from_paths([public_key_path(tmp_path / "b.pem")]).verify(bundle, what="it")
    assert unknown.value.key_id == key.key_id and other.key_id in str(unknown.value)
    with pytest.raises(NoTrustedKeys, match="COMPILESVC_TRUSTED_KEYS"):
        TrustedKeys({}).verify(bundle, what="it")
    document = json.loads(bundle)
    payload = json.loads(base64.b64decode(document["dsseEnvelope"]["payload"]))
    payload["predicateType"] = "changed"
    document["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    with pytest.raises(BadSignature, match=f"does not verify under key {key.key_id}"):
        trusted.verify(json.dumps(document).encode(), what="it")
    with pytest.raises(BadSignature, match="not a signature bundle"):
        trusted.verify(b"{}", what="it")


def test_the_artifact_statement_is_what_model_signing_verifies(tmp_path: Path) -> None:
    """Our statement, signed by our code, read and checked by the OpenSSF library's verifier on a directory."""
    from model_signing import verifying

    files = {"model.pt": b"compiled", "weights/a.bin": b"w" * 100, "weights-b.bin": b"other"}
    manifest = manifest_of(files)
    key = SigningKey.load_or_generate(tmp_path / "keys" / "k.pem")
    directory = tmp_path / "artifact"
    for name, data in files.items():
        (directory / "bucket-0" / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / "bucket-0" / name).write_bytes(data)
    (directory / "bucket-0" / "compile.log").write_bytes(b"log")  # ignored: covered by the manifest digest
    (directory / "manifest.json").write_bytes(manifest.to_bytes())
    (directory / "model.sig").write_bytes(ArtifactSigner(key, "b").sign_manifest(manifest))
    config = verifying.Config().use_elliptic_key_verifier(public_key=public_key_path(tmp_path / "keys" / "k.pem"))
    config.verify(directory, directory / "model.sig")
    resources = signature_statement(manifest)["predicate"]["resources"]
    assert [r["name"] for r in resources] == ["bucket-0/model.pt", "bucket-0/weights/a.bin", "bucket-0/weights-b.bin"]

    (directory / "bucket-0" / "weights" / "a.bin").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"weights/a\.bin"):
        verifying.Config().use_elliptic_key_verifier(
            public_key=public_key_path(tmp_path / "keys" / "k.pem")).verify(directory, directory / "model.sig")


def test_verify_artifact_names_what_differs(tmp_path: Path) -> None:
    key = SigningKey.load_or_generate(tmp_path / "k.pem")
    trusted = TrustedKeys({key.key_id: key.public_key})
    manifest = manifest_of({"model.pt": b"compiled"})
    bundle = ArtifactSigner(key, "b").sign_manifest(manifest)
    assert verify_artifact(trusted, bundle, manifest).key_id == key.key_id
    bigger = manifest.model_copy(deep=True)
    bigger.buckets[0].files[0].size += 1  # a size is not in the standard statement, but in the manifest digest
    with pytest.raises(BadSignature, match="changed after publication"):
        verify_artifact(trusted, bundle, bigger)
    # The attack: same key (files are no part of it), another file: the signature does not cover it.
    swapped = manifest_of({"model.pt": b"the attacker's model"})
    assert swapped.key == manifest.key
    with pytest.raises(BadSignature, match="changed after publication"):
        verify_artifact(trusted, bundle, swapped)
    # A signature moved from another artifact.
    elsewhere = manifest_of({"model.pt": b"compiled"}, model="ef" * 32)
    with pytest.raises(BadSignature, match=f"signs artifact {elsewhere.key}"):
        verify_artifact(trusted, ArtifactSigner(key, "b").sign_manifest(elsewhere), manifest)


def test_a_provenance_is_shown_only_for_the_artifact_it_is_about(tmp_path: Path) -> None:
    """The build page's check: a validly signed provenance of another artifact (or a signature statement)
    copied beside this artifact's manifest is not this artifact's provenance."""
    key = SigningKey.load_or_generate(tmp_path / "k.pem")
    trusted = TrustedKeys({key.key_id: key.public_key})
    signer = ArtifactSigner(key, "b")
    manifest = manifest_of({"model.pt": b"compiled"})
    other = manifest_of({"model.pt": b"compiled"}, model="ef" * 32)

    def provenance(of: ArtifactManifest) -> bytes:
        return signer.sign_provenance(provenance_statement(of, builder_id="b", workers=["w"], started_on=None,
                                                           finished_on=None))

    assert verify_provenance(trusted, provenance(manifest), manifest.key).key_id == key.key_id
    with pytest.raises(BadSignature, match="not an SLSA provenance of that artifact"):
        verify_provenance(trusted, provenance(other), manifest.key)
    with pytest.raises(BadSignature, match="not an SLSA provenance of that artifact"):
        verify_provenance(trusted, signer.sign_manifest(manifest), manifest.key)


@pytest.mark.slow
def test_the_fleet_side_imports_no_server_libraries() -> None:
    probe = ("import sys, compilesvc.fleet, compilesvc.cli.fetch, compilesvc.cli.verify, compilesvc.signing.keys; "
             "print(sorted(m for m in ('sqlalchemy', 'flask', 'celery', 'boto3', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_publisher_with_an_unusable_key_does_not_start(tmp_path: Path) -> None:
    key = SigningKey.load_or_generate(tmp_path / "signing-key.pem")
    assert key.path is not None
    os.chmod(key.path, 0o644)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")},
           "COMPILESVC_DATA_DIR": str(tmp_path / "data"), "COMPILESVC_SIGNING_KEY_FILE": str(key.path)}
    result = subprocess.run([sys.executable, "-m", "compilesvc", "relay"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: the signing key cannot be used: the signing key {key.path} may be "
                                     f"read by other users; run: chmod 600 {key.path}")
