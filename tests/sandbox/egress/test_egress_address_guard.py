"""Which addresses the egress proxy may dial: public ones, in no disguise."""

from __future__ import annotations

import ipaddress

import pytest

from sandbox.egress.address_guard import why_not_public

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.255.0.9", "a loopback address"),
        ("10.0.0.1", "a private address"),
        ("172.16.5.4", "a private address"),
        ("192.168.1.1", "a private address"),
        ("169.254.169.254", "the cloud metadata address"),
        ("169.254.1.1", "a link-local address"),
        ("100.64.0.1", "a shared (carrier-grade NAT) address"),
        ("0.0.0.0", "the unspecified address"),
        ("224.0.0.1", "a multicast address"),
        ("240.0.0.1", "a private address"),
        ("203.0.113.7", "a private address"),  # documentation range
        ("::1", "a loopback address"),
        ("::", "the unspecified address"),
        ("fe80::1", "a link-local address"),
        ("fc00::1", "a private address"),
        ("ff02::1", "a multicast address"),
        ("::ffff:127.0.0.1", "a loopback address in IPv6 form"),
        ("::ffff:169.254.169.254", "the cloud metadata address in IPv6 form"),
        ("2002:7f00:1::1", "a loopback address in IPv6 form"),  # 6to4
        ("2002:a00:1::", "a private address in IPv6 form"),
        ("64:ff9b::7f00:1", "a loopback address in IPv6 form"),  # NAT64, global in Python
        ("64:ff9b::a9fe:a9fe", "the cloud metadata address in IPv6 form"),
        # Not globally routable although Python 3.11's is_global says yes (deprecated ranges):
        ("fec0::1", "a site-local address (fec0::/10, deprecated)"),
        ("feff:ffff::1", "a site-local address (fec0::/10, deprecated)"),
        ("3ffe:b00::1", "a 6bone address (3ffe::/16, returned)"),
        ("5f00::1", "a 6bone or SRv6 address (5f00::/8), not routed on the internet"),
        ("3fff::1", "a documentation address (3fff::/20)"),
        ("::7f00:1", "a loopback address in IPv6 form"),  # IPv4-compatible, of 127.0.0.1
        ("::ffff:0:7f00:1", "a loopback address in IPv6 form"),  # SIIT-translated
        ("::808:808", "an IPv4-compatible address (::/96, deprecated)"),
        ("192.88.99.1", "a 6to4 relay anycast address (192.88.99.0/24, deprecated)"),
        ("192.0.0.8", "an IETF protocol assignment (192.0.0.0/24)"),
        (
            "::ffff:192.88.99.1",
            "a 6to4 relay anycast address (192.88.99.0/24, deprecated) in IPv6 form",
        ),
    ],
)
def test_non_public_addresses_are_named(address: str, why: str) -> None:
    assert why_not_public(ipaddress.ip_address(address)) == why


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34",
        "8.8.8.8",
        "2606:4700:4700::1111",
        "2001:4860:4860::8888",
        "::ffff:8.8.8.8",
        "3ffd:ffff::1",  # next to the ranges refused above, and still global
        "2a00:1450::1",
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert why_not_public(ipaddress.ip_address(address)) is None
