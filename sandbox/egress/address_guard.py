"""Which resolved addresses the proxy may dial: public ones only.

Why not just `is_global`: an IPv6 address can carry an IPv4 one (IPv4-mapped `::ffff:127.0.0.1`,
6to4 `2002:7f00:1::`, NAT64 `64:ff9b::7f00:1`), and some of those forms count as global in
Python's tables while reaching the host's loopback through a translator. The embedded address is
checked as well.

Nor is `is_global` alone enough on Python 3.11: its tables miss ranges that are not routed on
the internet (site-local `fec0::/10`, the returned 6bone `3ffe::/16`, the new documentation
`3fff::/20`, `192.0.0.0/24`, the deprecated 6to4 relay anycast `192.88.99.0/24`); those are
named here, and anything `is_global` refuses stays refused.
"""

from __future__ import annotations

import ipaddress

from code_interpreter_wire.network_policy import IpAddress

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_SIIT = ipaddress.ip_network("::ffff:0:0:0/96")  # an IPv4 address translated (RFC 6145)
_COMPATIBLE = ipaddress.ip_network("::/96")  # IPv4-compatible (deprecated): ::a.b.c.d
_METADATA = ipaddress.ip_address("169.254.169.254")
# Not globally routable, although some Python versions' `is_global` says they are (IANA's
# special-purpose registries, deprecated ranges included), each with what to call it.
_NOT_ROUTED: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.ip_network(network), name)
    for network, name in (
        ("fec0::/10", "a site-local address (fec0::/10, deprecated)"),
        ("3ffe::/16", "a 6bone address (3ffe::/16, returned)"),
        ("5f00::/8", "a 6bone or SRv6 address (5f00::/8), not routed on the internet"),
        ("3fff::/20", "a documentation address (3fff::/20)"),
        ("::/96", "an IPv4-compatible address (::/96, deprecated)"),
        ("192.88.99.0/24", "a 6to4 relay anycast address (192.88.99.0/24, deprecated)"),
        ("192.0.0.0/24", "an IETF protocol assignment (192.0.0.0/24)"),
    )
)


def _kind(address: IpAddress) -> str | None:
    """What makes one address not public, or None when it is public."""
    if address == _METADATA:
        return "the cloud metadata address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_unspecified:
        return "the unspecified address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    for network, name in _NOT_ROUTED:
        if address.version == network.version and address in network:
            return name
    if address.is_private:
        return "a private address"
    if address.is_reserved:
        return "a reserved address"
    if not address.is_global:
        return "not a public address"
    return None


def forms_of(address: IpAddress) -> list[IpAddress]:
    """The address and the IPv4 address it carries, if it is an IPv6 form of one: a rule about
    an IPv4 network must hold for every spelling a resolver may answer."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded(address)
        if inner is not None:
            return [address, inner]
    return [address]


def _embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, SIIT-translated, IPv4-compatible, 6to4,
    NAT64, Teredo server), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _SIIT or (address in _COMPATIBLE and int(address) > 1):  # not :: or ::1
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.teredo is not None:
        return address.teredo[1]
    return None


def why_not_public(address: IpAddress) -> str | None:
    """Why the proxy must not dial `address` (a phrase such as "a loopback address"), or None."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded(address)
        if inner is not None:
            why = _kind(inner)
            if why is not None:
                return f"{why} in IPv6 form"
            if address.ipv4_mapped is not None:
                return None  # the very IPv4 address, reached over a dual-stack socket
    return _kind(address)
