"""compilesvc's one HTTP client for its own API: JSON in and out, problems as :class:`ApiError`, network
failures and passing outages (429, 502-504) retried with backoff, so a POST made safe by an
Idempotency-Key survives a flaky network.

Used by the command-line client (:mod:`compilesvc.cli.connection`, :mod:`compilesvc.cli.builds`), ``compilesvc
dev`` and the fleet library (:mod:`compilesvc.fleet`), so it needs nothing beyond the standard library:
serving code that imports the fleet library pulls in no CLI framework.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from compilesvc.client.exits import for_status
from compilesvc.client.next_steps import next_step

TRANSPORT_RETRIES = 5  # 0.5 + 1 + 2 + 4 + 8 s of backoff: a network blip or an API restart
#: How long a request waits, by default, while the API hashes its model in the background (503 model-pinning).
PINNING_WAIT_SECONDS = 1800.0

class ApiError(Exception):
    """The API answered with a problem (``status``, ``problem``: its document), or could not be reached
    (``status`` None). The CLI prints it as one line, and every command exits with :attr:`exit_code`
    (:mod:`compilesvc.client.exits`: 3 for no answer or a passing outage, 2 for a refusal)."""

    def __init__(self, message: str, status: int | None = None, problem: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.problem = problem or {}

    @property
    def exit_code(self) -> int:
        return int(for_status(self.status))

    @property
    def problem_type(self) -> str:
        return str(self.problem.get("type", "")).rsplit("/", 1)[-1]


class RedirectRefused(ApiError):
    """The API answered a JSON call with a redirect. compilesvc's API never redirects its JSON calls, so
    one means a wrong base URL (http for https, a path prefix) or someone in between; following it would
    hand the bearer token to wherever it points. Not retried."""

    def __init__(self, status: int, base: str, location: str):
        super().__init__(f"the API at {base} answered HTTP {status} redirecting to {location or '(nowhere)'}; "
                         "compilesvc follows no redirects from its API (they would carry the token): set "
                         "COMPILESVC_API_URL (or the config file's api_url) to the address that answers", status)
        self.location = location


class _RefuseApiRedirects(urllib.request.HTTPRedirectHandler):
    """Every 3xx from the API is :class:`RedirectRefused`, raised before a request is made to its target."""

    def __init__(self, base: str):
        self.base = base

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        raise RedirectRefused(code, self.base, newurl)


def origin(url: str) -> tuple[str, str, int | None]:
    """RFC 6454 origin of an absolute URL: scheme, host, port (the scheme's default filled in)."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


class CredentialSafeRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects (a presigned download may be sent on by its store), but a request that leaves
    its origin loses ``Authorization`` and ``Cookie``, as browsers and ``requests`` do (requests'
    ``Session.rebuild_auth``; the Fetch standard's "HTTP-redirect fetch" step 13), and never goes from
    https to http."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        if urlsplit(req.full_url).scheme == "https" and urlsplit(newurl).scheme != "https":
            raise urllib.error.HTTPError(newurl, code, "refused a redirect from https to http", headers, fp)
        if origin(newurl) != origin(req.full_url):
            for name in ("Authorization", "Cookie", "Proxy-Authorization"):
                new.headers.pop(name.capitalize(), None)
                new.unredirected_hdrs.pop(name.capitalize(), None)
        return new


DOWNLOADS = urllib.request.build_opener(CredentialSafeRedirects)
"""The opener for download URLs (they carry their own credential; a store may redirect them)."""


def _api_error(status: int, body: bytes) -> ApiError:
    try:
        problem = json.loads(body)
        if not isinstance(problem, dict):
            raise ValueError("not an object")
    except ValueError:
        return ApiError(f"HTTP {status}: {body[:200].decode(errors='replace')}", status)
    text = f"HTTP {status} {problem.get('title', '')}: {problem.get('detail', '')}".strip()
    for err in problem.get("errors", [])[:5]:
        said = f"{err.get('field')}: {err.get('message')}"
        if said not in text:  # a detail that already lists its one field error says it once
            text += f"; {said}"
    return ApiError(text, status, problem)


def _auth_error(error: ApiError, token: str | None, token_source: str) -> ApiError:
    """A 401 or 403 told as what the person at the command line does about it: the API's own words are for
    HTTP callers ("send 'Authorization: Bearer <token>'")."""
    scope = error.problem.get("required_scope")
    needs = f" with the {scope} scope" if scope else ""
    if error.status == 401 and token is None:
        text = (f"no API token: set COMPILESVC_TOKEN (or token in the config file, docs/ci.md) to a token{needs}; "
                "an admin makes one with `compilesvc tokens create`")
    elif error.status == 401:
        text = (f"the API refused the token from {token_source}: it is unknown, expired or revoked; ask an admin "
                f"for a new one{needs} (`compilesvc tokens create`)")
    else:
        text = f"the token from {token_source} may not do this: {error.problem.get('detail', '')}; use a token{needs}"
    return ApiError(text, error.status, error.problem)


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt + 1`` of a failed request: 0.5, 1, 2, 4, then 8."""
    return float(min(0.5 * 2**attempt, 8.0))


#: Seconds of backoff before a request gives up on an unreachable API (15.5; docs/ci.md says it).
RETRY_BUDGET_SECONDS = sum(backoff(attempt) for attempt in range(TRANSPORT_RETRIES))


def _retry_after(exc: urllib.error.HTTPError, attempt: int) -> float:
    """The server's Retry-After (seconds, at most a minute), else the backoff."""
    value = exc.headers.get("Retry-After", "") if exc.headers else ""
    return float(min(int(value), 60)) if value.isdigit() else backoff(attempt)


class Api:
    """compilesvc's one HTTP client (the CLI's commands and ``compilesvc dev`` alike): JSON in and out,
    problems as :class:`ApiError`, transport failures retried ``retries`` times with backoff."""

    def __init__(self, base: str, timeout: float = 30.0, *, retries: int = TRANSPORT_RETRIES,
                 token: str | None = None, token_source: str | None = None,
                 pinning_wait: float = PINNING_WAIT_SECONDS,
                 on_pinning: Callable[[dict[str, Any]], None] | None = None,
                 on_retry: Callable[[str], None] | None = None):
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        #: A 503 model-pinning (the API hashes the request's model in the background) is progress, not an
        #: outage: the request is sent again after its Retry-After for up to ``pinning_wait`` seconds, not
        #: ``retries`` times, and ``on_pinning`` is told each such answer (its problem document).
        self.pinning_wait = pinning_wait
        self.on_pinning = on_pinning
        #: Told, before the first retry of a request, why it is retried and for how long (one sentence).
        self.on_retry = on_retry
        self.token = token
        #: Where the command line's token came from (COMPILESVC_TOKEN, the config file): with it, a 401 or
        #: 403 says what to set or ask for. None: a program's own client, told the API's words.
        self.token_source = token_source
        self._opener = urllib.request.build_opener(_RefuseApiRedirects(self.base))

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *,
                upload: Path | bytes | None = None, pinning_wait: float | None = None) -> Any:
        """JSON in (or ``upload``: a file, streamed, or bytes), JSON out; transport failures are retried with
        backoff (the caller makes POSTs safe: an Idempotency-Key, or content addressing for uploads), a model
        being pinned is waited for (``pinning_wait`` seconds, default :attr:`pinning_wait`)."""
        pinning_until: float | None = None
        url = path if path.startswith("http") else f"{self.base}{path}"
        data = json.dumps(body).encode() if body is not None else None
        all_headers = {"Accept": "application/json", **(headers or {})}
        if self.token:
            all_headers["Authorization"] = f"Bearer {self.token}"
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        if upload is not None:
            size = len(upload) if isinstance(upload, bytes) else upload.stat().st_size
            all_headers.update({"Content-Type": "application/octet-stream", "Content-Length": str(size),
                                "Content-Digest": _content_digest(upload)})
        attempt = 0
        while True:
            try:
                with contextlib.ExitStack() as stack:
                    # A file body streams from disk, and each attempt starts it again from the beginning.
                    payload = stack.enter_context(upload.open("rb")) if isinstance(upload, Path) else data
                    if isinstance(upload, bytes):
                        payload = upload
                    req = urllib.request.Request(url, data=payload, method=method, headers=all_headers)
                    with self._opener.open(req, timeout=self.timeout) as response:
                        return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                body_bytes = exc.read()
                kind = _problem_type(body_bytes)
                if exc.code == 503 and kind == "model-pinning":
                    if pinning_until is None:
                        wait = self.pinning_wait if pinning_wait is None else pinning_wait
                        pinning_until = time.monotonic() + wait
                    delay = _retry_after(exc, 0)
                    if time.monotonic() + delay <= pinning_until:  # else: the caller's wait is over, say so
                        if self.on_pinning is not None:
                            self.on_pinning(json.loads(body_bytes))
                        time.sleep(delay)
                        continue
                passing = exc.code in (429, 502, 503, 504) and kind not in _VERDICTS
                if passing and attempt < self.retries:
                    if attempt == 0 and self.on_retry is not None:
                        self.on_retry(f"the API at {self.base} answered HTTP {exc.code}; retrying up to "
                                      f"{self.retries} times, after its Retry-After or the backoff")
                    time.sleep(_retry_after(exc, attempt))
                    attempt += 1
                    continue
                error = _api_error(exc.code, body_bytes)
                if exc.code in (401, 403) and self.token_source is not None:
                    error = _auth_error(error, self.token, self.token_source)
                elif self.token_source is not None and (step := next_step(error.problem_type, error.message)):
                    error = ApiError(f"{error.message}; {step}", error.status, error.problem)  # the CLI's line
                raise error from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    where = " (--api, COMPILESVC_API_URL or the config file)" if self.token_source else ""
                    raise ApiError(f"cannot reach the API at {self.base}: {reason}; check the address{where}, or "
                                   "try again later") from None
                if attempt == 0 and self.on_retry is not None:
                    self.on_retry(f"cannot reach the API at {self.base}: {getattr(exc, 'reason', exc)}; retrying for "
                                  f"up to {sum(backoff(a) for a in range(self.retries)):g} s")
                time.sleep(backoff(attempt))
                attempt += 1


def _content_digest(upload: Path | bytes) -> str:
    """RFC 9530 ``Content-Digest`` (sha-256) of an upload. With its name known before the first byte, the
    server streams the body to its store as it arrives instead of spooling it first; and it checks the
    bytes end to end. Hashing a file costs a local read (about 1 GB/s), a fraction of sending it."""
    if isinstance(upload, bytes):
        digest = hashlib.sha256(upload).digest()
    else:
        with upload.open("rb") as source:
            digest = hashlib.file_digest(source, "sha256").digest()
    return f"sha-256=:{base64.b64encode(digest).decode()}:"


#: 503s that are not passing outages, so never retried as one: a verdict (no worker can serve this), and
#: model-pinning, which is progress, waited for (:attr:`Api.pinning_wait`) and then ends the request.
_VERDICTS = frozenset({"no-capable-worker", "model-pinning"})


def _problem_type(body: bytes) -> str:
    """The last segment of a problem document's ``type`` ("" for another body)."""
    try:
        document = json.loads(body)
    except ValueError:
        return ""
    return str(document.get("type", "")).rsplit("/", 1)[-1] if isinstance(document, dict) else ""
