"""Webhooks as the field writes them: a try connects to the address it checked (a name that answers differently
the second time reaches nothing else), every special-purpose range is refused (CGNAT, cloud metadata, IPv4 embedded
in 6to4/Teredo/NAT64/mapped addresses), no redirect is followed, and the Standard Webhooks library
(``standardwebhooks``) verifies what is sent, with the configured secret raw or in its ``whsec_`` form."""

from __future__ import annotations

import base64
import ipaddress
import re
import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest
from standardwebhooks import Webhook

from compilesvc.notify import destinations
from compilesvc.notify.destinations import blocked, resolve_checked
from compilesvc.notify.signatures import whsec
from compilesvc.notify.webhooks import Sender, verify
from tests.web.test_webhooks import Receiver

REAL = socket.getaddrinfo


class Rebinding:
    """A resolver for ``name`` answering each of ``answers`` in turn (the last one from then on); other names and
    address literals resolve as usual. ``asked`` counts the lookups of ``name``."""

    def __init__(self, name: str, answers: list[str]):
        self.name, self.answers, self.asked = name, answers, 0

    def __call__(self, host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host != self.name:
            return REAL(host, port, *args, **kwargs)
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        family = socket.AF_INET6 if ":" in answer else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (answer, port))]


@pytest.fixture
def plain_receiver() -> Iterator[Receiver]:
    server = Receiver([])
    yield server
    server.close()


def _sender(secret: bytes, allowed: str = "127.0.0.1/32") -> Sender:
    return Sender(cast(Any, None), secret=secret, public_url="http://api.test",
                  allowed=[ipaddress.ip_network(allowed)])


def test_a_name_answering_differently_the_second_time_reaches_only_the_checked_address(
        plain_receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    port = plain_receiver.server.server_address[1]
    # Checked: 127.0.0.1 (allowed here). A second lookup would answer the metadata service.
    resolver = Rebinding("rebind.test", ["127.0.0.1", "169.254.169.254"])
    monkeypatch.setattr(destinations, "getaddrinfo", resolver)
    monkeypatch.setattr(socket, "getaddrinfo", resolver)  # whatever else resolves the name gets the rebound answer
    status, error = _sender(b"k")._post(f"http://rebind.test:{port}/hook", 7, b"{}")
    assert (status, error) == (200, None)
    assert resolver.asked == 1
    headers, body, _ = plain_receiver.received[0]
    assert headers["Host"] == f"rebind.test:{port}" and body == b"{}"
    # The next try resolves again (once): the rebound answer is refused before anything connects.
    status, error = _sender(b"k")._post(f"http://rebind.test:{port}/hook", 7, b"{}")
    assert status is None and error is not None and "169.254.169.254, a cloud-metadata address" in error
    assert resolver.asked == 2 and len(plain_receiver.received) == 1


@pytest.mark.parametrize("address, kind", [
    ("100.64.0.1", "shared (CGNAT 100.64.0.0/10)"),
    ("100.127.255.254", "shared (CGNAT 100.64.0.0/10)"),
    ("100.100.100.200", "cloud-metadata"),
    ("169.254.169.254", "cloud-metadata"),
    ("fd00:ec2::254", "cloud-metadata"),
    ("2002:7f00:1::", "6to4 (carrying 127.0.0.1, loopback)"),
    ("2002:a9fe:a9fe::", "6to4 (carrying 169.254.169.254, cloud-metadata)"),
    ("64:ff9b::a9fe:a9fe", "NAT64 (carrying 169.254.169.254, cloud-metadata)"),
    ("64:ff9b::a00:1", "NAT64 (carrying 10.0.0.1, private)"),
    ("64:ff9b:1::808:808", "NAT64 (carrying 8.8.8.8, a local-use NAT64 prefix)"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo (carrying 192.0.2.45)"),
    ("::ffff:10.0.0.1", "IPv4-mapped (carrying 10.0.0.1, private)"),
    ("::127.0.0.1", "IPv4-compatible (carrying 127.0.0.1, loopback)"),
    ("192.0.2.1", "private"),
    ("198.18.0.1", "private"),
    ("192.88.99.1", "6to4 relay anycast"),
    ("2001:db8::1", "private"),
    ("100::1", "private"),
    ("fe80::1", "link-local"),
    ("ff02::1", "multicast"),
])
def test_special_purpose_ranges_are_refused(address: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert blocked(ipaddress.ip_address(address)) == kind
    monkeypatch.setattr(destinations, "getaddrinfo", Rebinding("hook.example", [address]))
    with pytest.raises(ValueError, match=re.escape(f"resolves to {ipaddress.ip_address(address)}, a {kind} address")):
        resolve_checked("https://hook.example/x")


def test_global_addresses_pass_and_one_blocked_answer_refuses_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for address in ("93.184.216.34", "2606:4700::1111", "2002:5db8:d822::"):  # the last: 6to4 of a public v4
        assert blocked(ipaddress.ip_address(address)) is None, address
    monkeypatch.setattr(destinations, "getaddrinfo", Rebinding("hook.example", ["93.184.216.34"]))
    checked = resolve_checked("https://hook.example:8443/x?y=1")
    assert (checked.address, checked.host, checked.port, checked.target) == ("93.184.216.34", "hook.example", 8443,
                                                                             "/x?y=1")

    def two(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("100.64.1.1", port))]

    monkeypatch.setattr(destinations, "getaddrinfo", two)
    with pytest.raises(ValueError, match=r"100\.64\.1\.1, a shared"):
        resolve_checked("https://hook.example/x")


def test_a_redirect_is_a_failed_try_not_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = Receiver([])
    redirecting = Receiver([307])
    try:
        status, error = _sender(b"k")._post(redirecting.url, 3, b"{}")
        assert (status, error) == (307, "HTTP 307") and elsewhere.received == []
    finally:
        redirecting.close()
        elsewhere.close()


@pytest.mark.parametrize("secret", [b"whsec-test-0123456789", b"whsec_" + base64.b64encode(b"\x00key bytes\xff")],
                         ids=["raw-secret", "whsec-secret"])
def test_the_standard_webhooks_library_verifies_our_signature(plain_receiver: Receiver, secret: bytes) -> None:
    status, _ = _sender(secret)._post(plain_receiver.url, 42, b'{"type":"build.succeeded"}')
    assert status == 200
    headers, body, _ = plain_receiver.received[0]
    assert headers["webhook-id"] == "whd_42" and headers["webhook-signature"].startswith("v1,")
    assert Webhook(whsec(secret)).verify(body, headers) == {"type": "build.succeeded"}
    if secret.startswith(b"whsec_"):
        assert whsec(secret) == secret.decode()  # the operator gives receivers the string they configured
    with pytest.raises(Exception, match="No matching signature"):
        Webhook(whsec(b"another secret")).verify(body, headers)
    # The deprecated headers, for one release.
    assert verify(secret, headers, body) and headers["Compilesvc-Webhook-Id"] == "whd_42"
