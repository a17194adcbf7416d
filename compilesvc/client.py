"""The HTTP client side of the CLI: what a CI pipeline and a serving fleet run.

:class:`Api` is the one HTTP client (the build commands of :mod:`compilesvc.build_cli`, ``compilesvc dev``):
JSON in and out, problems as :class:`ApiError`, network failures and passing outages (429, 502-504)
retried with backoff, so a POST made safe by an Idempotency-Key survives a flaky network.
``compilesvc upload`` streams a model; ``compilesvc fetch KEY DIR`` downloads a published artifact through
its expiring URLs, verifying every file's size and sha256 before it appears in DIR.

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
from pathlib import Path
from typing import Any, BinaryIO

import click

from compilesvc import client_config, fetch_dest
from compilesvc.cli import BadInput, CommandFailed
from compilesvc.store.base import BlobTooLarge
from compilesvc.store.hashing import copy_hashing

TRANSPORT_RETRIES = 5  # 0.5 + 1 + 2 + 4 + 8 s of backoff: a network blip or an API restart
API_OPTION = click.option(
    "--api", metavar="URL",
    help=f"The API (default: ${client_config.API_ENV}, else api_url in the config file, else "
         f"{client_config.DEFAULT_API}). The token comes from ${client_config.TOKEN_ENV} or the config file "
         "(docs/ci.md).")


class ApiError(click.ClickException):
    """The API answered with a problem (``status``, ``problem``: its document), or could not be reached
    (``status`` None). Exit status 1; the build commands map it to their own (:mod:`compilesvc.build_cli`)."""

    def __init__(self, message: str, status: int | None = None, problem: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.problem = problem or {}

    @property
    def problem_type(self) -> str:
        return str(self.problem.get("type", "")).rsplit("/", 1)[-1]


def _api_error(status: int, body: bytes) -> ApiError:
    try:
        problem = json.loads(body)
        if not isinstance(problem, dict):
            raise ValueError("not an object")
    except ValueError:
        return ApiError(f"HTTP {status}: {body[:200].decode(errors='replace')}", status)
    text = f"HTTP {status} {problem.get('title', '')}: {problem.get('detail', '')}".strip()
    for err in problem.get("errors", [])[:5]:
        text += f"; {err.get('field')}: {err.get('message')}"
    return ApiError(text, status, problem)


def _backoff(attempt: int) -> float:
    return float(min(0.5 * 2**attempt, 8.0))


def _retry_after(exc: urllib.error.HTTPError, attempt: int) -> float:
    """The server's Retry-After (seconds, at most a minute), else the backoff."""
    value = exc.headers.get("Retry-After", "") if exc.headers else ""
    return float(min(int(value), 60)) if value.isdigit() else _backoff(attempt)


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
                passing = exc.code in (429, 502, 503, 504) and not _is_refusal(body_bytes)
                if passing and attempt < self.retries:
                    time.sleep(_retry_after(exc, attempt))
                    continue
                raise _api_error(exc.code, body_bytes) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise ApiError(f"cannot reach the API at {self.base}: {reason}") from None
                time.sleep(_backoff(attempt))
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


@click.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@API_OPTION
def upload(path: Path, api: str | None) -> None:
    """Upload the model file PATH (streamed) and print its blob:sha256: URI, for a spec's model.uri."""
    result = connect(api, timeout=600).request("POST", "/v1/models", upload=path)
    click.echo(result["uri"])


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
