"""The client's address behind the reverse proxy: X-Forwarded-For, believed only from the proxy itself.

gunicorn takes the scheme from ``X-Forwarded-Proto`` when the peer is in ``forwarded_allow_ips`` but
leaves ``REMOTE_ADDR`` at the proxy's address. werkzeug's ``ProxyFix`` sets it from ``X-Forwarded-For``
but believes anyone; this middleware applies ``ProxyFix`` (one hop, the last address) only to requests
whose peer is in the same allow list gunicorn uses, so a client talking to ``compilesvc serve`` directly
cannot choose the address it is logged under.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.middleware.proxy_fix import ProxyFix

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def parse_allow_list(value: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None:
    """gunicorn's ``forwarded_allow_ips`` syntax: addresses or networks, comma-separated; ``*`` (None) = all."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if "*" in items:
        return None
    return [ipaddress.ip_network(item, strict=False) for item in items]


class TrustedProxy:
    """Wraps a WSGI app; requests from an allowed peer get ``REMOTE_ADDR`` from ``X-Forwarded-For``."""

    def __init__(self, app: WSGIApp, allow: str):
        self.app = app
        self.proxied = ProxyFix(app, x_for=1, x_proto=0, x_host=0, x_port=0, x_prefix=0)
        self.allow = parse_allow_list(allow)

    def __getattr__(self, name: str) -> Any:  # tests and tools reach the Flask app through the wrapper
        return getattr(self.app, name)

    def trusted(self, peer: str) -> bool:
        if self.allow is None:
            return True
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:  # a UNIX socket has no address: only the host's own processes reach it
            return True
        return any(address in network for network in self.allow)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self.trusted(str(environ.get("REMOTE_ADDR") or "")):
            return self.proxied(environ, start_response)
        return self.app(environ, start_response)
