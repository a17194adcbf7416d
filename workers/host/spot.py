"""Spot interruption notices: EC2 warns a Spot Instance two minutes before it stops or terminates it, through
the instance metadata (IMDSv2). A worker that watches for the notice drains at once, with a window that fits
in those two minutes (``COMPILESVC_SPOT_DRAIN_SECONDS``), instead of learning of it from the SIGTERM its
orchestrator may send too late, or never.

What EC2 documents, and this module does (AWS EC2 User Guide, "Spot Instance interruption notices"):
``instance-action`` appears in the metadata only once the instance is marked for interruption, as
``{"action": "terminate" | "stop" | "hibernate", "time": "<UTC>"}`` (absent: 404); check it every 5 seconds;
read it with an IMDSv2 session token (``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``,
then ``X-aws-ec2-metadata-token`` on the GET).

On Kubernetes a pod usually cannot reach the instance metadata (a hop limit of 1, as docs/deploy.md
advises); there Karpenter or the Node Termination Handler turns the notice into a drain of the node, and a
spot pool's own ``COMPILESVC_DRAIN_SECONDS`` must fit the two minutes (docs/kubernetes.md).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: EC2's advice: "We recommend that you check for these interruption notices every 5 seconds."
POLL_SECONDS = 5.0
TOKEN_TTL_SECONDS = 21600  # the longest IMDSv2 allows: one token serves hours of polls
_TIMEOUT = 2.0


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # the metadata service never redirects
        return None


_opener = urllib.request.build_opener(_NoRedirects)


class SpotWatcher:
    """Polls ``instance-action`` from a thread; calls ``on_notice(action, time)`` once, when it appears."""

    def __init__(self, imds_url: str, on_notice: Callable[[str, str], None], interval: float = POLL_SECONDS):
        self.base = imds_url.rstrip("/")
        self.on_notice = on_notice
        self.interval = interval
        self.stop = threading.Event()
        self._token: str | None = None
        self.thread = threading.Thread(target=self._run, name="spot-notice", daemon=True)

    def start(self) -> SpotWatcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                notice = self.check()
                failures = 0
            except Exception as exc:  # whatever the metadata service answers, the watch goes on
                failures += 1
                if failures in (1, 60):  # once, and again if it lasts five minutes: not a log line every 5 s
                    log.warning("spot notice check failed", extra={"error": f"{type(exc).__name__}: {exc}"})
                notice = None
            if notice is not None:
                self.on_notice(*notice)
                return
            self.stop.wait(self.interval)

    def check(self) -> tuple[str, str] | None:
        """``(action, time)`` once the instance is marked for interruption, else None."""
        if self._token is None:
            self._token = self._request("PUT", "/latest/api/token",
                                        {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)})
        try:
            body = self._request("GET", "/latest/meta-data/spot/instance-action",
                                 {"X-aws-ec2-metadata-token": self._token})
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None  # not marked for interruption
            if exc.code == 401:
                self._token = None  # expired: a new one next time
            raise
        document = json.loads(body)
        if not isinstance(document, dict):
            raise ValueError(f"instance-action is not an object: {body[:200]!r}")
        return str(document.get("action", "terminate")), str(document.get("time", ""))

    def _request(self, method: str, path: str, headers: dict[str, str]) -> str:
        request = urllib.request.Request(self.base + path, method=method, headers=headers)
        with _opener.open(request, timeout=_TIMEOUT) as response:
            return response.read(64 * 1024).decode()  # type: ignore[no-any-return]
