"""``compilesvc verify KEY|DIR``: is this artifact what the service signed, checked here with no trust in
the server.

- ``DIR``: a directory ``compilesvc fetch --dest`` wrote, or an artifact directory of the cache: its
  ``manifest.json`` (the fetch marker aside) must be the manifest ``model.sig`` signs, signed by a
  trusted key, and every file the manifest lists that is present (logs are optional) must have its size
  and sha256; every compiled file must be present, and no other file may be (as ``model_signing verify``
  refuses files a signature does not cover). Never touches the network.
- ``KEY``: the artifact in the local cache, checked the same way (``--offline``: the cache only;
  otherwise what is missing is fetched and verified as ``compilesvc fetch`` does).

Exit status: 0 verified; 1 something could not be read (the API, the cache, the directory); 2 the
argument is neither a key nor a directory; 3 not trusted: no signature, a signature that does not
verify, a key that is not trusted, a file that differs from the signed manifest, a symbolic link in DIR (the
signature says ``allow_symlinks: false``), no trusted key configured. The message names the file and the key id.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from compilesvc.cli.connection import API_OPTION
from compilesvc.cli.fetch import NotTrusted
from compilesvc.cli.fetch_dest import MARKER, OWN_NAMES
from compilesvc.cli.main import BadInput, CommandFailed
from compilesvc.fleet import (
    ArtifactSet,
    CacheError,
    FilesDiffer,
    FleetError,
    HostCheck,
    ServedDiffers,
    Untrusted,
    Verify,
)
from compilesvc.fleet._cache import file_matches
from compilesvc.signing.artifacts import GIT_PATHS, SIGNATURE_FILE, verify_artifact
from compilesvc.signing.keys import KeyFileError, SignatureError, TrustedKeys
from compilesvc.spec.manifest import ArtifactManifest, ManifestMismatch, parse_artifact_manifest, safe_relative
from compilesvc.store.base import SHA256_RE


def _trusted() -> TrustedKeys:
    try:
        return TrustedKeys.from_environment()
    except KeyFileError as exc:
        raise NotTrusted(f"refused: the trusted keys cannot be read: {exc}") from None


def _read_manifest(directory: Path) -> ArtifactManifest:
    path = directory / "manifest.json"
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise BadInput(f"{directory} has no manifest.json: it is not a fetched artifact directory") from None
    except (OSError, ValueError) as exc:
        raise CommandFailed(f"cannot read {path}: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("key"), str):
        raise NotTrusted(f"refused: {path} is not an artifact manifest")
    document.pop(MARKER, None)  # fetch --dest's record of what it wrote: not part of the signed manifest
    try:
        return parse_artifact_manifest(json.dumps(document).encode(), document["key"])
    except ManifestMismatch as exc:
        raise NotTrusted(f"refused: {path}: {exc}") from None


def verify_directory(directory: Path, trusted: TrustedKeys) -> tuple[ArtifactManifest, str, int]:
    """(manifest, signing key id, files checked) of a verified artifact directory; :class:`NotTrusted`."""
    manifest = _read_manifest(directory)
    try:
        bundle = (directory / SIGNATURE_FILE).read_bytes()
    except FileNotFoundError:
        raise NotTrusted(f"refused: {directory} has no {SIGNATURE_FILE}: artifact {manifest.key} is unsigned "
                         "here") from None
    except OSError as exc:
        raise CommandFailed(f"cannot read {directory / SIGNATURE_FILE}: {exc.strerror}") from None
    try:
        key_id = verify_artifact(trusted, bundle, manifest).key_id
    except SignatureError as exc:
        raise NotTrusted(f"refused: {exc}") from None
    checked = 0
    expected = {SIGNATURE_FILE, "manifest.json"}
    for bucket in manifest.buckets:
        logs = [bucket.log] if bucket.log is not None else []
        expected.update(bucket.placed(e) for e in [*bucket.files, *logs])
    _refuse_symlinks(directory, manifest.key)
    # As the standard verifier does: a file the signature does not cover is refused, not ignored (a serving
    # process may load what lies beside the model).
    for found in sorted(directory.rglob("*")):
        name = found.relative_to(directory).as_posix()
        if (found.is_file() or found.is_symlink()) and name not in expected and \
                name.split("/")[0] not in (*GIT_PATHS, *OWN_NAMES):
            raise NotTrusted(f"refused: {name} in {directory} is not part of artifact {manifest.key}")
    for bucket in manifest.buckets:
        logs = [bucket.log] if bucket.log is not None else []
        for entry in [*bucket.files, *logs]:
            relative = safe_relative(bucket.placed(entry))
            path = directory / relative
            if entry in logs and not path.exists():
                continue  # logs are fetched only on request
            if not file_matches(path, entry, Verify.SHA256):
                state = "is missing" if not path.exists() else "differs from the signed manifest (size or sha256)"
                raise NotTrusted(f"refused: {relative} of artifact {manifest.key} {state}; signed by key {key_id}")
            checked += 1
    return manifest, key_id, checked


def _refuse_symlinks(directory: Path, key: str) -> None:
    """:class:`NotTrusted` at the first symbolic link under ``directory`` (a file or a directory replaced by one):
    the signed statement says ``allow_symlinks: false`` (:mod:`compilesvc.signing.artifacts`), and model_signing's
    verifier refuses a link then (sigstore/model-transparency, ``model_signing._serialization.serialization.
    check_file_or_directory(path, allow_symlinks=False)``). A link's target is whatever its writer chose: reading
    through it would check bytes the signature never named, and a serving process would load them."""
    for root, dirnames, filenames in os.walk(directory):  # followlinks=False: a linked directory is not entered
        for name in sorted([*dirnames, *filenames]):
            path = Path(root) / name
            if path.is_symlink():
                relative = path.relative_to(directory).as_posix()
                raise NotTrusted(f"refused: {relative} in {directory} is a symbolic link (to {os.readlink(path)}); "
                                 f"the signature of artifact {key} allows none (allow_symlinks: false)")


@click.command("verify")
@click.argument("target")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The artifact cache KEY is looked up in (default: $COMPILESVC_CACHE_DIR, else ~/.cache/compilesvc).")
@click.option("--offline", is_flag=True, help="KEY: the cache only, never the API.")
@API_OPTION
def verify(target: str, cache_dir: Path | None, offline: bool, api: str | None) -> None:
    """Verify artifact KEY (in the local cache) or directory DIR (from fetch --dest) against the trusted public
    keys ($COMPILESVC_TRUSTED_KEYS): its signature, then every file's size and sha256.

    Exit status: 0 verified; 1 something could not be read; 2 TARGET is neither a key nor a directory;
    3 not trusted (see docs/fleet.md).
    """
    trusted = _trusted()
    directory = Path(target)
    if directory.is_dir():
        manifest, key_id, checked = verify_directory(directory, trusted)
        click.echo(f"{manifest.key}: signature by key {key_id} verified; {checked} file(s) match the signed "
                   f"manifest in {directory}")
        return
    if not SHA256_RE.match(target):
        raise BadInput(f"{target!r} is neither an artifact key (64 lowercase hex digits) nor a directory")
    try:
        artifact = ArtifactSet.open(target, cache_dir=cache_dir, api_url=api, offline=offline,
                                    host_check=HostCheck.OFF, trusted_keys=trusted)
    except (Untrusted, FilesDiffer, ServedDiffers) as exc:
        raise NotTrusted(f"refused: {exc}") from None
    except (FleetError, CacheError) as exc:
        raise CommandFailed(str(exc)) from None
    report = artifact.report
    click.echo(f"{report.key}: signature by key {report.key_id} verified; {report.files} file(s) match the "
               f"signed manifest in {report.directory}")
