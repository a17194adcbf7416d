"""Where a webhook may be sent: a URL's host resolved once, every address checked, and the request sent to the
address that was checked.

Why once: checking a name and then letting ``urllib`` resolve it again to connect let a name answer a public
address to the check and 169.254.169.254 to the connection (DNS rebinding). :func:`resolve_checked` resolves the
host once, refuses the URL if any answer is of a blocked kind, and returns the address :func:`post` then connects
to (the name stays the TLS server name and the ``Host`` header, so certificates are checked against the name).
Redirects are not followed: ``http.client`` follows none, and a 3xx is a failed try.

Blocked (unless inside an operator's ``COMPILESVC_WEBHOOK_ALLOW_NETWORKS``): every address Python's ``ipaddress``
does not call globally reachable (``is_global`` is false for the IANA IPv4 and IPv6 Special-Purpose Address
Registries' non-global entries: loopback, private, link-local incl. 169.254.169.254, CGNAT 100.64.0.0/10 incl.
Alibaba's 100.100.100.200, ULA fc00::/7 incl. AWS's fd00:ec2::254, documentation, benchmarking, Teredo …), plus
multicast and reserved, plus what the registries list as global but carries an IPv4 address inside: 6to4
(2002::/16, RFC 3056), Teredo (2001::/32, RFC 4380: server and client), NAT64 (64:ff9b::/96 RFC 6052,
64:ff9b:1::/48 RFC 8215), IPv4-mapped and IPv4-compatible: the embedded IPv4 address is checked by the same rules.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Named explicitly although ``is_global`` already refuses them: the cloud metadata services.
METADATA = {ipaddress.ip_address("169.254.169.254"): "cloud-metadata", ipaddress.ip_address("fd00:ec2::254"):
            "cloud-metadata", ipaddress.ip_address("100.100.100.200"): "cloud-metadata"}
CGNAT = ipaddress.ip_network("100.64.0.0/10")
#: Deprecated 6to4 relay anycast (RFC 7526; "Global: N/A" in the IANA registry, global to ``ipaddress``): a relay
#: into 6to4, whose addresses carry any IPv4 address.
SIXTOFOUR_RELAY = ipaddress.ip_network("192.88.99.0/24")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_KINDS = ("is_loopback", "is_link_local", "is_private", "is_multicast", "is_unspecified", "is_reserved")

#: ``socket.getaddrinfo``, looked up when called (tests give it a resolver that answers differently each time).
getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo


def _embedded(address: Address) -> tuple[str, ipaddress.IPv4Address] | None:
    """The IPv4 address an IPv6 address carries, and how."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return "IPv4-mapped", address.ipv4_mapped
    if address.sixtofour is not None:
        return "6to4", address.sixtofour
    if address.teredo is not None:
        return "Teredo", address.teredo[1]  # the client's (obfuscated in the address, decoded here)
    if address in NAT64 or address in NAT64_LOCAL:
        return "NAT64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 and int(address) > 1:
        return "IPv4-compatible", ipaddress.IPv4Address(int(address))
    return None


def blocked(address: Address) -> str | None:
    """Why ``address`` may not be called (a short kind), or None."""
    if address in METADATA:
        return METADATA[address]
    embedded = _embedded(address)
    if embedded is not None:
        how, inner = embedded
        if isinstance(address, ipaddress.IPv6Address) and address.teredo is not None:
            return f"Teredo (carrying {inner})"  # a tunnel to wherever its server relays: never a webhook
        inner_kind = blocked(inner)
        if inner_kind is not None or address in NAT64_LOCAL:
            return f"{how} (carrying {inner}, {inner_kind or 'a local-use NAT64 prefix'})"
    if isinstance(address, ipaddress.IPv4Address) and address in CGNAT:
        return "shared (CGNAT 100.64.0.0/10)"
    if isinstance(address, ipaddress.IPv4Address) and address in SIXTOFOUR_RELAY:
        return "6to4 relay anycast"
    for name in _KINDS:
        if getattr(address, name):
            return name.removeprefix("is_").replace("_", "-")
    if not address.is_global:
        return "special-purpose (not globally reachable)"
    return None


@dataclass(frozen=True)
class Destination:
    """A URL whose host resolved to ``address``, checked: what :func:`post` connects to."""

    scheme: str
    host: str
    port: int
    target: str  # path and query, as sent
    address: str


def resolve_checked(url: str, allowed: Iterable[Network] = ()) -> Destination:
    """Refuse (ValueError) a URL compilesvc must not call: not http(s), no host, credentials in it, or a host with
    an address of a blocked kind outside the ``allowed`` networks; else the address to connect to."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise ValueError("credentials in the URL are not accepted; the signature authenticates compilesvc")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise ValueError(f"cannot resolve {parts.hostname}: {exc}") from None
    allowed = tuple(allowed)
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not addresses:
        raise ValueError(f"{parts.hostname} resolves to no address")
    for address in addresses:
        kind = blocked(address)
        if kind and not any(address in network for network in allowed):
            raise ValueError(f"{parts.hostname} resolves to {address}, a {kind} address; an operator may allow "
                             "its network with COMPILESVC_WEBHOOK_ALLOW_NETWORKS")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Destination(parts.scheme, parts.hostname, port, target, str(addresses[0]))


def post(destination: Destination, body: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST ``body`` to the checked address; the answer's status. The connection goes to ``destination.address``
    only (``http.client`` resolves nothing else: ``_create_connection`` is the one place it connects, Lib/http/
    client.py ``HTTPConnection.connect``); HTTPS wraps that socket with the host name as the server name and
    checks its certificate against it (``HTTPSConnection.connect``, default context). OSError on no answer."""
    connection: http.client.HTTPConnection
    if destination.scheme == "https":
        connection = http.client.HTTPSConnection(destination.host, destination.port, timeout=timeout)
    else:
        connection = http.client.HTTPConnection(destination.host, destination.port, timeout=timeout)

    def pinned(address: tuple[str, int], timeout: float | None = None, source: Any = None) -> socket.socket:
        return socket.create_connection((destination.address, address[1]), timeout, source)

    connection._create_connection = pinned  # type: ignore[attr-defined]
    try:
        connection.request("POST", destination.target, body=body, headers=headers)
        response = connection.getresponse()
        response.read(64 * 1024)  # a receiver's answer is not ours to keep; bounded
        return int(response.status)
    except http.client.HTTPException as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    finally:
        connection.close()
