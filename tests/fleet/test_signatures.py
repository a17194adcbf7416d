"""Signed artifacts, as a fleet checks them: a manifest or a file changed in the store or in the cache after
publication, a key nobody trusts, no trusted key at all, a key rotation, the provenance, and the OpenSSF
standard verifier on a ``fetch --dest`` directory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from compilesvc.fleet import ArtifactSet, FilesDiffer, Untrusted
from compilesvc.signing.artifacts import SLSA_PREDICATE, ArtifactSigner, manifest_digest
from compilesvc.signing.keys import TRUSTED_KEYS_ENV, SigningKey, TrustedKeys, public_key_path
from compilesvc.spec.manifest import parse_artifact_manifest
from compilesvc.store.base import artifact_manifest_name, blob_name
from tests.fixtures.signing import public_key_of
from tests.fleet.conftest import FleetApi

NOT_TRUSTED = 3  # compilesvc fetch / verify: the artifact is not trusted (docs/fleet.md)


def store_root(api: FleetApi) -> Path:
    return Path(urlsplit(api.env.services.settings.resolved_store_url).path)


def rewrite(path: Path, data: bytes) -> None:
    """What an attacker with write access to the store or the cache does: replace a read-only file."""
    os.chmod(path, 0o644)
    path.write_bytes(data)


def swap_first_file(manifest: dict[str, Any], sha256: str, size: int) -> dict[str, Any]:
    """The issue's attack: one file's sha256 and size rewritten to those of other bytes (the key still
    derives, since files are no part of it)."""
    manifest["buckets"][0]["files"][0].update(sha256=sha256, size=size)
    return manifest


def cli(api: FleetApi, command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "compilesvc", command, *args], capture_output=True, text=True,
                          timeout=120, env={**api.environ(), **(env or {})})


def test_a_manifest_changed_in_the_store_is_refused_by_fetch_open_and_verify(fleet_api: FleetApi,
                                                                            tmp_path: Path) -> None:
    key = fleet_api.publish()
    evil = fleet_api.env.services.store.put_stream(io.BytesIO(b"the attacker's model"))
    path = store_root(fleet_api) / artifact_manifest_name(key)
    tampered = swap_first_file(json.loads(path.read_bytes()), evil.sha256, evil.size)
    rewrite(path, json.dumps(tampered, indent=1, sort_keys=True).encode())

    fetched = fleet_api.fetch(key)
    assert fetched.returncode == NOT_TRUSTED, fetched.stderr
    assert "is not the one key" in fetched.stderr and "changed after publication" in fetched.stderr
    signer = fleet_api.env.services.signer
    assert signer is not None and signer.key.key_id in fetched.stderr
    with pytest.raises(Untrusted, match="changed after publication") as refused:
        ArtifactSet.open(key, cache_dir=tmp_path / "lib-cache", api_url=fleet_api.base, token=fleet_api.token)
    assert refused.value.key_id == signer.key.key_id
    verified = cli(fleet_api, "verify", key)
    assert verified.returncode == NOT_TRUSTED and "changed after publication" in verified.stderr
    assert fleet_api.blob_gets(evil.sha256) == 0  # refused before a byte of any file was downloaded
    assert not (fleet_api.cache / "v1" / "artifacts" / key).exists()


def test_a_file_changed_in_the_store_is_refused(fleet_api: FleetApi) -> None:
    key = fleet_api.publish(size=4096)
    first = fleet_api.manifest(key)["buckets"][0]["files"][0]
    rewrite(store_root(fleet_api) / blob_name(first["sha256"]), b"x" * first["size"])
    fetched = fleet_api.fetch(key)
    assert fetched.returncode == 1, fetched.stderr  # a download that does not verify, as before signatures
    assert "model.pt: the download's sha256" in fetched.stderr and "nothing was installed" in fetched.stderr
    assert not (fleet_api.cache / "v1" / "artifacts" / key).exists()


def test_a_cache_changed_on_disk_is_refused_offline(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = fleet_api.publish(size=1024)
    assert fleet_api.fetch(key).returncode == 0
    directory = fleet_api.cache / "v1" / "artifacts" / key
    assert cli(fleet_api, "verify", str(directory)).returncode == 0
    assert cli(fleet_api, "verify", "--offline", key).returncode == 0
    fleet_api.stop()  # offline from here on

    # A file changed: refused, naming it (fetch: damaged, exit 1; verify: not trusted, exit 3).
    model = directory / "bucket-0" / "model.pt"
    original = model.read_bytes()
    model.unlink()  # a hard link to the blob: the attacker puts another file in its place
    model.write_bytes(b"y" * len(original))
    offline = fleet_api.fetch(key, "--offline")
    assert offline.returncode == 1 and "bucket-0/model.pt" in offline.stderr and "damaged" in offline.stderr
    for target in (str(directory), key):
        verified = cli(fleet_api, "verify", "--offline", target) if target == key else cli(fleet_api, "verify", target)
        assert verified.returncode == NOT_TRUSTED, verified.stderr
        assert "bucket-0/model.pt" in verified.stderr
    with pytest.raises(FilesDiffer, match=r"bucket-0/model\.pt"):
        ArtifactSet.open(key, cache_dir=fleet_api.cache, offline=True)

    # The manifest changed to name the new file: the signature no longer covers it.
    manifest_path = directory / "manifest.json"
    manifest = parse_artifact_manifest(manifest_path.read_bytes(), key).model_dump(mode="json", by_alias=True)
    swap_first_file(manifest, hashlib.sha256(model.read_bytes()).hexdigest(), len(original))
    rewrite(manifest_path, parse_artifact_manifest(json.dumps(manifest).encode(), key).to_bytes())
    offline = fleet_api.fetch(key, "--offline")
    assert offline.returncode == NOT_TRUSTED and "changed after publication" in offline.stderr
    with pytest.raises(Untrusted, match="changed after publication"):
        ArtifactSet.open(key, cache_dir=fleet_api.cache, offline=True)

    # And a cache entry without its signature is not used offline.
    (directory / "model.sig").unlink()
    rewrite(manifest_path, manifest_path.read_bytes())
    unsigned = fleet_api.fetch(key, "--offline")
    assert unsigned.returncode == NOT_TRUSTED and "has no signature" in unsigned.stderr


def test_an_unknown_key_and_no_key_are_refused(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = fleet_api.publish()
    stranger = SigningKey.load_or_generate(tmp_path / "stranger" / "key.pem")
    other = {TRUSTED_KEYS_ENV: str(public_key_path(stranger.path))}  # type: ignore[arg-type]
    refused = cli(fleet_api, "fetch", key, env=other)
    assert refused.returncode == NOT_TRUSTED, refused.stderr
    signer = fleet_api.env.services.signer
    assert signer is not None
    assert f"signed by key {signer.key.key_id}, which is not a trusted key" in refused.stderr
    assert stranger.key_id in refused.stderr  # what is trusted, so the operator sees the mismatch

    nothing = cli(fleet_api, "fetch", key, env={TRUSTED_KEYS_ENV: "", "COMPILESVC_CONFIG": str(tmp_path / "none")})
    assert nothing.returncode == NOT_TRUSTED and TRUSTED_KEYS_ENV in nothing.stderr
    assert "no trusted public keys are configured" in nothing.stderr

    # Trusted through the client config file instead of the environment.
    config = tmp_path / "config.toml"
    config.write_text(f'trusted_keys = "{public_key_of(fleet_api.env.services)}"\n')
    through_file = cli(fleet_api, "fetch", key, env={TRUSTED_KEYS_ENV: "", "COMPILESVC_CONFIG": str(config)})
    assert through_file.returncode == 0, through_file.stderr


def test_key_rotation(fleet_api: FleetApi, tmp_path: Path) -> None:
    services = fleet_api.env.services
    old = services.signer
    assert old is not None
    before = fleet_api.publish(buckets=((1, 8),))
    new_key = SigningKey.load_or_generate(tmp_path / "keys" / "new.pem")
    keys = tmp_path / "trusted"
    keys.mkdir()
    shutil.copy(public_key_of(services), keys / "old.pem")
    shutil.copy(public_key_path(tmp_path / "keys" / "new.pem"), keys / "new.pem")
    services.signer = ArtifactSigner(new_key, old.builder_id)  # the publishers switch keys
    after = fleet_api.publish(buckets=((2, 8),))
    assert old.key.key_id != new_key.key_id

    both = {TRUSTED_KEYS_ENV: str(keys)}
    for key, signer in ((before, old.key), (after, new_key)):
        fetched = cli(fleet_api, "fetch", key, "--json", env=both)
        assert fetched.returncode == 0, fetched.stderr
        assert json.loads(fetched.stdout)["key_id"] == signer.key_id

    (keys / "old.pem").unlink()  # the old key retired: what it signed is no longer trusted, offline too
    only_new = {TRUSTED_KEYS_ENV: str(keys)}
    assert cli(fleet_api, "fetch", after, "--offline", env=only_new).returncode == 0
    stale = cli(fleet_api, "fetch", before, "--offline", env=only_new)
    assert stale.returncode == NOT_TRUSTED and f"signed by key {old.key.key_id}" in stale.stderr


def test_provenance_is_served_signed_and_says_how_it_was_built(fleet_api: FleetApi) -> None:
    key = fleet_api.publish(versions={"torch": "2.13.0", "compilesvc": "0.1.0"})
    headers = {"Authorization": f"Bearer {fleet_api.token}"}
    answer = fleet_api.env.app.test_client().get(f"/v1/artifacts/{key}/provenance", headers=headers)
    assert answer.status_code == 200
    trusted = TrustedKeys.from_paths([public_key_of(fleet_api.env.services)])
    statement = trusted.verify(answer.get_data(), what="provenance").statement
    assert statement["predicateType"] == SLSA_PREDICATE
    manifest = parse_artifact_manifest(fleet_api.env.services.store.read_document(artifact_manifest_name(key)) or b"",
                                       key)
    subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    assert subjects["manifest.json"] == manifest_digest(manifest)
    for bucket in manifest.buckets:
        assert subjects[f"bucket-{bucket.position}/model.pt"] == bucket.files[0].sha256
    definition = statement["predicate"]["buildDefinition"]
    assert definition["externalParameters"]["components"] == manifest.components
    dependencies = {d["name"]: d for d in definition["resolvedDependencies"]}
    assert dependencies["model"]["digest"]["sha256"] == manifest.material["model"]["sha256"]
    assert dependencies["torch"]["uri"] == "pkg:pypi/torch@2.13.0"
    run = statement["predicate"]["runDetails"]
    assert run["builder"]["id"] == fleet_api.env.services.settings.public_url
    assert run["builder"]["builderDependencies"]  # the workers that compiled it
    assert run["metadata"]["startedOn"] <= run["metadata"]["finishedOn"]
    signature = fleet_api.env.app.test_client().get(f"/v1/artifacts/{key}/signature", headers=headers)
    assert signature.status_code == 200 and signature.json["dsseEnvelope"]["payloadType"]  # type: ignore[index]
    keys = fleet_api.env.app.test_client().get("/v1/artifacts/signing-keys", headers=headers)
    assert keys.status_code == 200
    signer = fleet_api.env.services.signer
    assert signer is not None
    assert keys.json["keys"] == [{"key_id": signer.key.key_id, "public_key": signer.key.public_pem.decode(),  # type: ignore[index]
                                  "current": True}]
    unknown = fleet_api.env.app.test_client().get(f"/v1/artifacts/{'0' * 64}/provenance", headers=headers)
    assert unknown.status_code == 404 and unknown.json["type"].endswith("artifact-not-found")  # type: ignore[index]


def test_the_standard_verifier_accepts_a_fetched_directory(fleet_api: FleetApi, tmp_path: Path) -> None:
    model_signing = shutil.which("model_signing", path=str(Path(sys.executable).parent))
    assert model_signing is not None, "model-signing is a dev dependency"
    key = fleet_api.publish(size=2048)
    dest = tmp_path / "dest"
    fetched = fleet_api.fetch(key, "--dest", str(dest), "--with-logs")
    assert fetched.returncode == 0, fetched.stderr
    public = public_key_of(fleet_api.env.services)

    def standard() -> subprocess.CompletedProcess[str]:
        return subprocess.run([model_signing, "verify", "key", "--signature", str(dest / "model.sig"),
                               "--public_key", str(public), str(dest)], capture_output=True, text=True, timeout=120)

    accepted = standard()
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert cli(fleet_api, "verify", str(dest)).returncode == 0
    # --replace still recognises the directory (model.sig is one of the files fetch wrote).
    assert fleet_api.fetch(key, "--dest", str(dest), "--replace").returncode == 0

    extra = dest / "bucket-0" / "libpatch.so"  # beside the model, where a loader may pick it up
    extra.write_bytes(b"not signed")
    stranger = cli(fleet_api, "verify", str(dest))
    assert stranger.returncode == NOT_TRUSTED and "bucket-0/libpatch.so" in stranger.stderr
    assert standard().returncode != 0
    extra.unlink()
    model = dest / "bucket-0" / "model.pt"
    model.write_bytes(b"z" * model.stat().st_size)
    rejected = standard()
    assert rejected.returncode != 0 and "bucket-0/model.pt" in rejected.stdout + rejected.stderr
    ours = cli(fleet_api, "verify", str(dest))
    assert ours.returncode == NOT_TRUSTED and "bucket-0/model.pt" in ours.stderr


def test_an_unsigned_artifact_is_refused_until_the_migration_signs_it(fleet_api: FleetApi) -> None:
    services = fleet_api.env.services
    signer = services.signer
    services.signer = None  # a deployment that published with publish_unsigned
    key = fleet_api.publish(buckets=((1, 8),))
    damaged = fleet_api.publish(buckets=((4, 8),))
    services.signer = signer  # then the deployment got its key; the fleet trusts it
    blob = fleet_api.manifest(damaged)["buckets"][0]["files"][0]
    rewrite(store_root(fleet_api) / blob_name(blob["sha256"]), b"changed while unsigned")
    headers = {"Authorization": f"Bearer {fleet_api.token}"}
    missing = fleet_api.env.app.test_client().get(f"/v1/artifacts/{key}/signature", headers=headers)
    assert missing.status_code == 404 and missing.json["type"].endswith("artifact-unsigned")  # type: ignore[index]
    refused = fleet_api.fetch(key)
    assert refused.returncode == NOT_TRUSTED and "sign-artifacts" in refused.stderr

    settings = services.settings
    assert signer is not None and signer.key.path is not None
    env = {"COMPILESVC_DATA_DIR": str(settings.data_dir), "COMPILESVC_DATABASE_URL": settings.resolved_database_url,
           "COMPILESVC_STORE_URL": settings.resolved_store_url, "COMPILESVC_SIGNING_KEY_FILE": str(signer.key.path),
           "COMPILESVC_PUBLIC_URL": settings.public_url}
    migrated = cli(fleet_api, "sign-artifacts", "--all", env=env)
    assert migrated.returncode == 1, migrated.stderr  # one could not be verified: it is not signed
    assert f"{key}: verified and signed with key {signer.key.key_id}" in migrated.stdout
    assert f"{damaged}: not signed: bucket-0/model.pt: the stored bytes differ from the manifest" in migrated.stderr
    assert cli(fleet_api, "fetch", damaged).returncode == NOT_TRUSTED
    assert fleet_api.fetch(key).returncode == 0
    again = cli(fleet_api, "sign-artifacts", key, env=env)
    assert again.returncode == 0 and "already signed" in again.stdout


def test_a_file_replaced_by_a_symlink_to_the_same_bytes_is_refused_as_model_signing_refuses_it(
        fleet_api: FleetApi, tmp_path: Path) -> None:
    model_signing = shutil.which("model_signing", path=str(Path(sys.executable).parent))
    assert model_signing is not None, "model-signing is a dev dependency"
    key = fleet_api.publish(size=2048)
    dest = tmp_path / "dest"
    assert fleet_api.fetch(key, "--dest", str(dest)).returncode == 0
    model = dest / "bucket-0" / "model.pt"
    elsewhere = tmp_path / "elsewhere.pt"  # the same bytes today; whatever its writer puts there tomorrow
    elsewhere.write_bytes(model.read_bytes())
    model.unlink()
    model.symlink_to(elsewhere)
    ours = cli(fleet_api, "verify", str(dest))
    assert ours.returncode == NOT_TRUSTED, ours.stderr
    assert ours.stderr == (f"error: refused: bucket-0/model.pt in {dest} is a symbolic link (to {elsewhere}); the "
                           f"signature of artifact {key} allows none (allow_symlinks: false)\n")
    standard = subprocess.run([model_signing, "verify", "key", "--signature", str(dest / "model.sig"),
                               "--public_key", str(public_key_of(fleet_api.env.services)), str(dest)],
                              capture_output=True, text=True, timeout=120)
    assert standard.returncode != 0 and "symlink" in (standard.stdout + standard.stderr).lower()
    # A linked directory too (its files are not walked into).
    model.unlink()
    model.write_bytes(elsewhere.read_bytes())
    assert cli(fleet_api, "verify", str(dest)).returncode == 0
    (dest / "bucket-0").rename(tmp_path / "bucket-0")
    (dest / "bucket-0").symlink_to(tmp_path / "bucket-0")
    linked = cli(fleet_api, "verify", str(dest))
    assert linked.returncode == NOT_TRUSTED and "bucket-0 in" in linked.stderr and "symbolic link" in linked.stderr
