"""The HTTP client side of the CLI: what a CI pipeline and a serving fleet run.

``compilesvc submit SPEC --wait`` validates the spec locally, submits it (retrying transport failures with
one Idempotency-Key, so a retried POST never makes a second build), follows the build and exits 0 only
when the artifact is published, printing its key. ``compilesvc fetch KEY DIR`` downloads a published
artifact through its expiring URLs, verifying every file's size and sha256 before it appears in DIR.

Only the standard library speaks HTTP here, so the core keeps its dependency list short.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import click

from compilesvc import client_config, fetch_dest
from compilesvc.cli import BadInput, CommandFailed
from compilesvc.spec_parsing import SpecError, load_spec_file
from compilesvc.states import BucketState, BuildState
from compilesvc.store.base import BlobTooLarge
from compilesvc.store.hashing import copy_hashing

TRANSPORT_RETRIES = 4
API_OPTION = click.option(
    "--api", metavar="URL",
    help=f"The API (default: ${client_config.API_ENV}, else api_url in the config file, else "
         f"{client_config.DEFAULT_API}). The token comes from ${client_config.TOKEN_ENV} or the config file "
         "(docs/ci.md).")


class ApiError(click.ClickException):
    """The API answered with a problem (exit 1), or could not be reached."""


def _problem_line(status: int, body: bytes) -> str:
    try:
        problem = json.loads(body)
    except ValueError:
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"
    text = f"HTTP {status} {problem.get('title', '')}: {problem.get('detail', '')}".strip()
    for err in problem.get("errors", [])[:5]:
        text += f"; {err.get('field')}: {err.get('message')}"
    return text


class Api:
    """compilesvc's one HTTP client (the CLI's commands and ``compilesvc dev`` alike): JSON in and out,
    problems as :class:`ApiError`, transport failures retried ``retries`` times with backoff."""

    def __init__(self, base: str, timeout: float = 30.0, *, retries: int = TRANSPORT_RETRIES,
                 token: str | None = None):
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.token = token

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *,
                upload: Path | bytes | None = None) -> Any:
        """JSON in (or ``upload``: a file, streamed, or bytes), JSON out; transport failures are retried with
        backoff (the caller makes POSTs safe: an Idempotency-Key, or content addressing for uploads)."""
        url = path if path.startswith("http") else f"{self.base}{path}"
        data = json.dumps(body).encode() if body is not None else None
        all_headers = {"Accept": "application/json", **(headers or {})}
        if self.token:
            all_headers["Authorization"] = f"Bearer {self.token}"
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        if upload is not None:
            size = len(upload) if isinstance(upload, bytes) else upload.stat().st_size
            all_headers.update({"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        for attempt in range(self.retries + 1):
            try:
                with contextlib.ExitStack() as stack:
                    # A file body streams from disk, and each attempt starts it again from the beginning.
                    payload = stack.enter_context(upload.open("rb")) if isinstance(upload, Path) else data
                    if isinstance(upload, bytes):
                        payload = upload
                    req = urllib.request.Request(url, data=payload, method=method, headers=all_headers)
                    with urllib.request.urlopen(req, timeout=self.timeout) as response:
                        return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                body_bytes = exc.read()
                if exc.code in (502, 503, 504) and attempt < self.retries and not _is_refusal(body_bytes):
                    time.sleep(2**attempt)
                    continue
                raise ApiError(_problem_line(exc.code, body_bytes)) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise ApiError(f"cannot reach the API at {self.base}: {reason}") from None
                time.sleep(2**attempt)
        raise AssertionError("unreachable")


def connect(api: str | None, timeout: float = 30.0) -> Api:
    """The client of the API named by ``--api`` (or the environment, or the config file), with the token."""
    try:
        config = client_config.load(api)
    except client_config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    return Api(config.api_url, timeout, token=config.token)


def _is_refusal(body: bytes) -> bool:
    """A 503 that is a verdict (no worker can serve this), not a passing outage."""
    try:
        return "no-capable-worker" in str(json.loads(body).get("type", ""))
    except ValueError:
        return False


def _summarise_failure(build: dict[str, Any]) -> str:
    failed = [b for b in build.get("buckets", []) if b.get("state") in (BucketState.FAILED, BucketState.CANCELLED)]
    parts = [f"build {build.get('build_id', build.get('id'))} {build['state']}"]
    for bucket in failed[:3]:
        parts.append(f"bucket {bucket['key'][:12]} {bucket['state']} ({bucket.get('error_class')}"
                     f"{' ' + bucket['error_code'] if bucket.get('error_code') else ''}): "
                     f"{(bucket.get('error_message') or '').strip()[:200]}")
    return "; ".join(parts)


@click.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@API_OPTION
def upload(path: Path, api: str | None) -> None:
    """Upload the model file PATH (streamed) and print its blob:sha256: URI, for a spec's model.uri."""
    result = connect(api, timeout=600).request("POST", "/v1/models", upload=path)
    click.echo(result["uri"])


@click.command("submit")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=str))
@API_OPTION
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow the build until it ends.")
@click.option("--timeout", type=float, default=6 * 3600, show_default=True, help="Seconds to wait at most.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Seconds between status checks.")
@click.option("--logs", is_flag=True, help="Print the build's compiler log to stderr while waiting.")
@click.option("--idempotency-key", help="Same key, same build (default: one random key per invocation).")
@click.option("--queue-anyway", is_flag=True, help="Queue even when no live worker serves the spec yet.")
def submit(spec_path: str, api: str | None, wait: bool, timeout: float, poll: float, logs: bool,
           idempotency_key: str | None, queue_anyway: bool) -> None:
    """Submit SPEC; print the artifact key once it is published (exit 1 if the build fails)."""
    try:
        # Element bounds and extra compiler flags are the service's settings, which this host may not share:
        # the API judges them.
        spec = load_spec_file(spec_path, limits=None, extra_flags=None)
    except SpecError as exc:
        raise click.UsageError(f"{spec_path}: {exc}") from None
    client = connect(api)
    headers = {"Idempotency-Key": idempotency_key or f"cli-{uuid.uuid4()}"}
    path = "/v1/builds" + ("?queue_anyway=true" if queue_anyway else "")
    result = client.request("POST", path, spec.model_dump(mode="json", exclude_none=True), headers)
    if "build_id" not in result:  # a hit answers with the artifact itself
        click.echo(result["key"])
        return
    build_id = result["build_id"]
    click.echo(f"build {build_id} {result['outcome']}: {result.get('status_url', '')}", err=True)
    if not wait:
        click.echo(result["artifact_key"])
        return
    deadline = time.monotonic() + timeout
    after = 0
    while True:
        if logs:
            page = client.request("GET", f"/v1/builds/{build_id}/logs?after={after}&limit=1000")
            for line in page.get("lines", []):
                click.echo(f"[{line['bucket_key'][:8]}] {line['line']}", err=True)
            after = page.get("next_after", after)
        build = client.request("GET", f"/v1/builds/{build_id}")
        if build["state"] == BuildState.SUCCEEDED:
            click.echo(build["artifact_key"])
            return
        if build["state"] != BuildState.BUILDING:
            raise ApiError(_summarise_failure(build))
        if time.monotonic() > deadline:
            raise ApiError(f"build {build_id} still building after {timeout:.0f} s: {result.get('status_url')}")
        time.sleep(poll)


def _download(url: str, out: BinaryIO, name: str, size: int, sha256: str) -> None:
    """Stream ``url`` into ``out``, checking its size and sha256 (the staging directory is private, so a
    file that fails is discarded with it)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            copied = copy_hashing(response.read, out.write, max_bytes=size)
    except BlobTooLarge:
        raise ApiError(f"{name}: expected {size} bytes, got more; nothing was written") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise ApiError(f"downloading {name} failed: {getattr(exc, 'reason', exc)}; nothing was written") from None
    if copied.size != size or copied.sha256 != sha256:
        raise ApiError(f"{name}: expected {size} bytes with sha256 {sha256}, got {copied.size} bytes with "
                       f"sha256 {copied.sha256}; nothing was written")
    out.flush()
    os.fsync(out.fileno())


@click.command("fetch")
@click.argument("key")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@API_OPTION
@click.option("--with-logs", is_flag=True, help="Also download each bucket's compile log.")
@click.option("--replace", is_flag=True,
              help="DEST may hold an earlier fetch (recognised by its manifest.json); replace it. Anything "
                   "else in DEST is still refused.")
def fetch(key: str, dest: Path, api: str | None, with_logs: bool, replace: bool) -> None:
    """Download published artifact KEY into DEST/bucket-<position>/, verifying every sha256.

    DEST must be absent or an empty directory (such as an empty "."); a DEST that is absent appears
    complete in one rename. Nothing already in DEST is ever deleted: with --replace, only the files of an
    earlier fetch are replaced, and only once the new ones are verified.

    Exit status: 0 written and verified; 1 the API, a download or the file system failed, or another
    fetch into DEST is running (DEST unchanged); 2 the command line is wrong: KEY is malformed, DEST is
    not empty (without --replace), or holds anything an earlier fetch did not write (DEST unchanged).
    """
    if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
        raise BadInput(f"{key!r} is not an artifact key (64 lowercase hex digits)")
    dest = Path(os.path.abspath(dest))  # "." and "a/.." name a directory, not a path to rename
    try:
        replace_existing = fetch_dest.check(dest, replace)
    except fetch_dest.DestRefused as exc:
        raise BadInput(str(exc)) from None
    client = connect(api)
    manifest = client.request("GET", f"/v1/artifacts/{urllib.parse.quote(key)}")
    planned = []
    try:
        for bucket in manifest["buckets"]:
            entries = [*bucket["files"], *([bucket["log"]] if with_logs and bucket.get("log") else [])]
            for entry in entries:
                relative = fetch_dest.safe_relative(f"bucket-{int(bucket['position'])}/{entry['path']}")
                planned.append((relative, entry))
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(f"the artifact manifest from {client.base} cannot be used: {exc}") from None
    try:
        with fetch_dest.staging_for(dest, replace_existing) as staging:
            for relative, entry in planned:
                with staging.open_file(relative) as out:
                    _download(entry["url"], out, str(relative), entry["size"], entry["sha256"])
                staging.written[str(relative)] = {"size": entry["size"], "sha256": entry["sha256"]}
            staging.write_manifest(manifest, key)
            staging.install()
    except fetch_dest.DestRefused as exc:
        raise BadInput(str(exc)) from None
    except fetch_dest.DestBusy as exc:
        raise CommandFailed(str(exc)) from None
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        raise CommandFailed(f"cannot write{where}: {exc.strerror or exc}") from None
    click.echo(f"{dest}: {len(planned)} files verified")
