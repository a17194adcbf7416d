"""The client's one exit-status contract (docs/ci.md, "Exit statuses"): what every command that talks to
the API exits with, and how an API answer, or no answer, maps to it.

Standard library only: :mod:`compilesvc.client.api` attaches the status to each :class:`ApiError` it
raises, so a command that lets one escape exits as one that catches it would.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """The CLI's exit statuses (docs/ci.md)."""

    OK = 0             # done; for a build: built, or a hit
    COMPILE_ERROR = 1  # the model does not compile (the compiler said so, or failed the same way every try)
    BAD_INPUT = 2      # the spec, a flag, the command line, the API URL or the token is wrong, or refused
    INFRA = 3          # timed out, or the service or its infrastructure failed (unreachable): try again
    CANCELLED = 4      # someone cancelled the build


def for_status(status: int | None) -> Exit:
    """The exit status of an API failure: no answer (``None``: unreachable after the retries), a 5xx, a 408
    or a 429 left after the retries are the service's and passing (3); every other refusal, 401 and 403 (the
    token), 404 (no such build, key or blob) and 4xx (the request) included, is the caller's to fix (2)."""
    if status is None or status >= 500 or status in (408, 429):
        return Exit.INFRA
    return Exit.BAD_INPUT
