"""``compilesvc fetch``: a published artifact into the local cache (and, with ``--dest``, a directory).

The cache (:mod:`compilesvc.fleet`) does the work: a key present and verified is served with no network;
what is missing is downloaded in parallel, resumed where an earlier fetch stopped, and each blob is
downloaded once however many fetches run at once. ``--dest`` then copies the verified files out under
:mod:`compilesvc.cli.fetch_dest`'s rules (never touching a file of the user's).

Every fetch checks the manifest's signature against the trusted keys (``COMPILESVC_TRUSTED_KEYS`` or the
config file's ``trusted_keys``) before any file is used, from the cache (offline too) or downloaded;
``--dest`` gets the signature as ``model.sig`` beside the files, which ``model_signing verify key`` accepts.

Exit status: 0 written and verified; 1 the API, a download, the cache or the file system failed, the
artifact is not published, this host cannot load it (``--check-host``), or another fetch into DEST is
running; 2 the command line is wrong (KEY malformed, no KEY and no --spec, a spec that does not
validate, a DEST that is not empty or not an earlier fetch's, an API URL that is not http(s)), or the API
refused the token (401, 403); 3 the artifact is not trusted: its
signature is missing or does not verify (its manifest was changed), it was signed by a key that is not
trusted, or no trusted key is configured. A file that differs from the (signed) manifest is refused as
before, naming it, with status 1: downloaded, it is not installed; cached, it is fetched again, or offline
refused as damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

import click

from compilesvc.cli import fetch_dest
from compilesvc.cli.connection import API_OPTION
from compilesvc.cli.main import BadInput, CommandFailed, SpecUsageError
from compilesvc.client import config as client_config
from compilesvc.client.next_steps import NEXT_STEPS
from compilesvc.fleet import (
    ArtifactSet,
    CacheError,
    FetchReport,
    FleetError,
    HostCheck,
    NotPublished,
    Progress,
    Untrusted,
)
from compilesvc.fleet._cache import Placed, placed_files
from compilesvc.signing.artifacts import SIGNATURE_FILE
from compilesvc.spec.parsing import SpecError, load_spec_file
from compilesvc.store.base import SHA256_RE
from compilesvc.store.hashing import copy_hashing

MIB = 1024 * 1024


class NotTrusted(CommandFailed):
    """The artifact's signature or a file did not verify against the trusted keys (exit status 3)."""

    exit_code = 3


class _Bar(Progress):
    """Progress on stderr: a redrawn line on a terminal (at most ten times a second); elsewhere only the
    waits, so CI logs stay short."""

    def __init__(self, enabled: bool):
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.lock = threading.Lock()
        self.total = self.done = 0
        self.started = self.drawn = 0.0

    def start(self, files: int, total_bytes: int) -> None:
        with self.lock:
            self.total, self.started = total_bytes, time.monotonic()
        if self.tty:
            click.echo(f"downloading {files} file(s), {total_bytes / MIB:.1f} MiB", err=True)

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = time.monotonic()
            if not self.tty or (now - self.drawn < 0.1 and self.done < self.total):
                return
            self.drawn = now
            rate = self.done / max(now - self.started, 1e-3) / MIB
            percent = 100 * self.done / self.total if self.total else 100
            click.echo(f"\r{percent:5.1f}% {self.done / MIB:.1f}/{self.total / MIB:.1f} MiB {rate:.1f} MiB/s",
                       err=True, nl=self.done >= self.total)

    def waiting(self, name: str) -> None:
        if self.enabled:
            click.echo(f"{name}: another process is downloading it; waiting for that download", err=True)


def _open(ref: Any, cache_dir: Path | None, api: str | None, offline: bool, verify: str, check_host: bool,
          with_logs: bool, parallel: int, progress: Progress) -> FetchReport:
    return open_set(ref, cache_dir, api, offline, verify, check_host, with_logs, parallel, progress).report


def open_set(ref: Any, cache_dir: Path | None, api: str | None, offline: bool, verify: str, check_host: bool,
             with_logs: bool, parallel: int, progress: Progress) -> ArtifactSet:
    """``ArtifactSet.open`` with its failures as this command's exit statuses (shared with ``serve-env``)."""
    if not offline:
        try:  # a wrong API URL or config file is the command line's mistake (exit 2), as for every command
            client_config.load(api)
        except client_config.ConfigError as exc:
            raise BadInput(str(exc)) from None
    try:
        artifact = ArtifactSet.open(ref, cache_dir=cache_dir, api_url=api, offline=offline, verify=verify,
                                    host_check=HostCheck.REFUSE if check_host else HostCheck.OFF,
                                    with_logs=with_logs, parallel=parallel, progress=progress)
    except Untrusted as exc:
        raise NotTrusted(f"refused: {exc}") from None
    except NotPublished as exc:  # what to do differs: no such key, or a build not done yet
        step = NEXT_STEPS["artifact-not-published" if exc.state else "artifact-not-found"]
        raise CommandFailed(f"{exc}; {step}") from None
    except FleetError as exc:
        if exc.status in (401, 403):  # the token: exit 2, as for every command (docs/ci.md)
            raise BadInput(str(exc)) from None
        raise CommandFailed(str(exc)) from None
    except CacheError as exc:
        raise CommandFailed(str(exc)) from None
    except OSError as exc:
        raise _cannot("the cache cannot be written", exc) from None
    return artifact


def _cannot(what: str, exc: OSError) -> CommandFailed:
    where = f" {exc.filename}" if exc.filename else ""
    return CommandFailed(f"{what}{where}: {exc.strerror or exc}")


def _copy_out(report: FetchReport, placed: list[Placed], staging: fetch_dest.Staging) -> None:
    """The cached files into DEST (copied, so DEST is the user's own; re-verified on the way)."""
    for p in placed:
        with open(report.directory / p.relative, "rb") as source, staging.open_file(p.relative) as out:
            copied = copy_hashing(source.read, out.write)
            if copied.sha256 != p.entry.sha256 or copied.size != p.entry.size:
                raise CacheError(f"{report.directory / p.relative} changed while it was copied; fetch again")
            out.flush()
            os.fsync(out.fileno())
        staging.written[str(p.relative)] = {"size": p.entry.size, "sha256": p.entry.sha256}
    with staging.open_file(PurePosixPath(SIGNATURE_FILE)) as out:
        out.write(report.signature)
    staging.written[SIGNATURE_FILE] = {"size": len(report.signature),
                                       "sha256": hashlib.sha256(report.signature).hexdigest()}
    staging.write_manifest(report.manifest.model_dump(mode="json", by_alias=True), report.key)
    staging.install()


def _summary(report: FetchReport) -> str:
    size = f"{report.files} file(s), {report.bytes / MIB:.1f} MiB"
    signed = f"signed by key {report.key_id[:16]}…"
    if not report.network:
        return f"{report.key}: {size} verified, {signed}, all from the cache (no network)"
    resumed = f", {len(report.resumed)} resumed" if report.resumed else ""
    return (f"{report.key}: {size} verified, {signed}: {report.downloaded} downloaded "
            f"({report.received_bytes / MIB:.1f} MiB{resumed}), {report.from_cache} from the cache")


@click.command("fetch")
@click.argument("key", required=False)
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Fetch the artifact of this spec file (resolved to its key by the API; offline, by the key "
                   "the cache remembers from the last fetch of the same spec).")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path),
              help="Also copy the verified files into DEST/bucket-<position>/ (absent or empty; see --replace).")
@click.option("--replace", is_flag=True,
              help="DEST may hold an earlier fetch (recognised by its manifest.json); replace it. Anything "
                   "else in DEST is still refused.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The artifact cache (default: $COMPILESVC_CACHE_DIR, else ~/.cache/compilesvc). It may be "
                   "read-only when the artifact is in it.")
@click.option("--offline", is_flag=True, help="Never contact the API: the cache only.")
@click.option("--with-logs", is_flag=True, help="Also download each bucket's compile log.")
@click.option("--verify", type=click.Choice(["sha256", "size"]), default="sha256", show_default=True,
              help="How cached files are checked before use: every byte, or sizes only.")
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Files downloaded at once.")
@click.option("--check-host", is_flag=True,
              help="Refuse (exit 1) unless this host's torch / torch-neuronx / runtime / CPU match the "
                   "artifact's recorded versions.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the directory.")
@click.option("-q", "--quiet", is_flag=True, help="No progress or summary on stderr.")
@API_OPTION
def fetch(key: str | None, spec_path: Path | None, dest: Path | None, replace: bool, cache_dir: Path | None,
          offline: bool, with_logs: bool, verify: str, parallel: int, check_host: bool, as_json: bool,
          quiet: bool, api: str | None) -> None:
    """Fetch published artifact KEY (or --spec SPEC) into the local cache, verifying every sha256, and print
    its directory (DEST with --dest).

    A second fetch of a cached key makes no network request. Downloads run in parallel, resume where an
    interrupted fetch stopped (HTTP ranges), and many fetches of one key at once download each file once.

    The manifest's signature is checked against the trusted keys ($COMPILESVC_TRUSTED_KEYS) first.

    Exit status: 0 verified; 1 the API, a download, the cache or the file system failed (a file that differs
    from the signed manifest included), or the artifact is not published; 2 the command line, the API URL or
    the token is wrong; 3 not
    trusted: no signature or one that does not verify, an unknown key, no trusted key (see docs/fleet.md).
    """
    if (key is None) == (spec_path is None):
        raise BadInput("give an artifact KEY or --spec SPEC (one of them)")
    if key is not None and not SHA256_RE.match(key):
        raise BadInput(f"{key!r} is not an artifact key (64 lowercase hex digits)")
    ref: Any = key
    if spec_path is not None:
        try:
            ref = load_spec_file(spec_path, limits=None, extra_flags=None)  # the service checks its limits
        except SpecError as exc:
            raise SpecUsageError(str(spec_path), exc) from None
    progress = _Bar(not quiet and not as_json)
    if dest is None:
        report = _open(ref, cache_dir, api, offline, verify, check_host, with_logs, parallel, progress)
        directory = report.directory
    else:
        dest = Path(os.path.abspath(dest))  # "." and "a/.." name a directory, not a path to rename
        try:
            replace_existing = fetch_dest.check(dest, replace)  # refused before any download
            # DEST is locked for the whole fetch: a second fetch into it fails at once instead of racing.
            with fetch_dest.staging_for(dest, replace_existing) as staging:
                report = _open(ref, cache_dir, api, offline, verify, check_host, with_logs, parallel, progress)
                _copy_out(report, placed_files(report.manifest, with_logs=with_logs), staging)
        except fetch_dest.DestRefused as exc:
            raise BadInput(str(exc)) from None
        except (fetch_dest.DestBusy, CacheError) as exc:
            raise CommandFailed(str(exc)) from None
        except OSError as exc:
            raise _cannot("cannot write", exc) from None
        directory = dest
    if as_json:
        click.echo(json.dumps(_document(report, directory), indent=1))
    else:
        click.echo(str(directory))
        if not quiet:
            click.echo(_summary(report), err=True)


def _document(report: FetchReport, directory: Path) -> dict[str, Any]:
    return {"key": report.key, "directory": str(directory), "cache_directory": str(report.directory),
            "files": report.files, "bytes": report.bytes, "downloaded": report.downloaded,
            "from_cache": report.from_cache, "received_bytes": report.received_bytes,
            "resumed": report.resumed, "network": report.network, "key_id": report.key_id}

