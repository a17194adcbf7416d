"""An endpoint's declared access: the kinds a view may declare, how it declares them, and what each needs
under a deployment's settings.

Declarations live with the request/response contract because both the enforcement (:mod:`web.auth`, one
``before_request`` hook) and the API description (:mod:`web.contract.openapi`, each operation's security)
read them; neither may disagree with the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from compilesvc.access.tokens import Permission
from compilesvc.config.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

PUBLIC = "public"
SIGNED_URL = "signed-url"
METRICS = "metrics"
#: What a view may declare: a permission, or one of the open kinds.
Access = Permission | str


def access(level: Access) -> Callable[[F], F]:
    """Declare the access of a view that has no :func:`web.contract.openapi.operation` (UI pages, documents)."""

    def mark(view: F) -> F:
        view._access = level  # type: ignore[attr-defined]
        return view

    return mark


def declared_access(endpoint: str, view: Callable[..., Any] | None) -> Access:
    """A view's declared access (``admin`` when it declares none: closed by default). Static files (CSS,
    JS) are public: Flask's own view serves them."""
    if endpoint == "static" or endpoint.endswith(".static"):
        return PUBLIC
    op = getattr(view, "_openapi", None)
    if op is not None and op.access is not None:
        return op.access  # type: ignore[no-any-return]
    return getattr(view, "_access", Permission.ADMIN)


#: What ``open_reads`` opens to requests without a token.
OPENED_BY_OPEN_READS = (Permission.READ, Permission.ARTIFACTS)


def needed(level: Access, settings: Settings) -> Permission | None:
    """The permission a request needs under ``settings`` (None: no token needed)."""
    if level in (PUBLIC, SIGNED_URL):
        return None
    if level == METRICS:
        return None if settings.public_metrics else Permission.READ
    permission = Permission(level)
    if settings.open_reads and permission in OPENED_BY_OPEN_READS:
        return None
    return permission


def checks_sent_token(level: Access, settings: Settings) -> bool:
    """Whether a token sent with the request is checked (401 when unknown, expired or revoked): wherever one
    is needed, and on open reads, where it is optional (RFC 6750 section 3.1: a client with a mistyped or
    revoked token learns it at its first call, not at its first write). Public operations, signed URLs and a
    public /metrics never look (a scraper's stale token must not blank the on-call's dashboards)."""
    return needed(level, settings) is not None or level in OPENED_BY_OPEN_READS
