"""The API as a fleet sees it: a published artifact's manifest with fresh download URLs, and a spec
resolved to its key. Everything the API says about an artifact is checked against the key before it is
used: the manifest's material must derive the key the fleet asked for, so a wrong or tampered answer
cannot hand a host another model's binary.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from compilesvc.client.api import Api, ApiError
from compilesvc.spec.manifest import ArtifactManifest, ManifestMismatch, parse_artifact_manifest


class FleetError(Exception):
    """The fleet library could not hand out an artifact; the message says why and what to do. ``status``:
    the API's HTTP status when it refused (401 and 403 are the token's), else None."""

    status: int | None = None


class Unreachable(FleetError):
    """The API could not be reached (and the artifact is not in the local cache)."""


class NotPublished(FleetError):
    """The API knows no published artifact for this key or spec (``state`` says what it is doing)."""

    def __init__(self, message: str, state: str | None = None):
        super().__init__(message)
        self.state = state


class Untrusted(FleetError):
    """The artifact's signature does not verify against the trusted keys (or there is none, or no key is
    configured): nothing of it is used. ``key_id`` names the signing key when it is known."""

    def __init__(self, message: str, key_id: str | None = None):
        super().__init__(message)
        self.key_id = key_id


@dataclass
class Published:
    """A verified manifest and the download URL of each of its blobs (by sha256), signed just now."""

    manifest: ArtifactManifest
    urls: dict[str, str]
    urls_expire_in: int


def _failure(exc: ApiError, what: str) -> FleetError:
    if exc.status is None:
        return Unreachable(str(exc))
    if exc.status == 404:
        state = exc.problem.get("state")
        return NotPublished(f"{what}: {exc.problem.get('detail') or exc}", str(state) if state else None)
    error = FleetError(f"{what}: {exc}")
    error.status = exc.status
    return error


class Remote:
    """What the fleet asks the API (through :class:`compilesvc.client.api.Api`, with its retries)."""

    def __init__(self, api: Api):
        self.api = api

    @property
    def base(self) -> str:
        return self.api.base

    def published(self, key: str) -> Published:
        try:
            described = self.api.request("GET", f"/v1/artifacts/{urllib.parse.quote(key)}")
        except ApiError as exc:
            raise _failure(exc, f"artifact {key}") from None
        try:
            urls: dict[str, str] = {}
            for bucket in described["buckets"]:
                for entry in [*bucket["files"], *([bucket["log"]] if bucket.get("log") else [])]:
                    urls[entry["sha256"]] = entry.pop("url")
            ttl = int(described.pop("urls_expire_in"))
            manifest = parse_artifact_manifest(json.dumps(described).encode(), key)
        except ManifestMismatch as exc:
            raise FleetError(f"the API at {self.base} answered with a manifest that is not key {key}'s: "
                             f"{exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise FleetError(f"the artifact manifest from {self.base} cannot be used: {exc!r}") from None
        return Published(manifest, urls, ttl)

    def signature(self, key: str) -> bytes:
        """The artifact's signature bundle as the store holds it (verified by the caller, never trusted)."""
        try:
            bundle = self.api.request("GET", f"/v1/artifacts/{urllib.parse.quote(key)}/signature")
        except ApiError as exc:
            if exc.status == 404 and exc.problem.get("state") == "published":
                raise Untrusted(f"artifact {key} is published without a signature: an administrator signs it "
                                "(compilesvc sign-artifacts) or rebuilds it (docs/deploy.md)") from None
            raise _failure(exc, f"the signature of artifact {key}") from None
        return json.dumps(bundle, indent=1).encode()

    def resolve(self, spec: dict[str, Any]) -> tuple[str, str]:
        """The key of ``spec`` and its state (``published``, ``building``, ``absent``, …)."""
        try:
            answer = self.api.request("POST", "/v1/artifacts/resolve", spec)
        except ApiError as exc:
            raise _failure(exc, "resolving the spec") from None
        return str(answer["key"]), str(answer["state"])
