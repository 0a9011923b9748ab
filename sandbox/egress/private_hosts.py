"""The operator's exceptions to "public addresses only": `host:port` entries, each letting one
name reach a private, loopback or link-local address on one port. A name alone means its
ports 80 and 443, never every port: a name pointing at 127.0.0.1 must not open every listener
of the host (the service's API, a database, a debugger)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from code_interpreter_wire.network_policy import address_of
from sandbox.egress.target import BadTarget, split_authority

BARE_NAME_PORTS = frozenset({80, 443})
_SYNTAX = "write host, host:port or [ipv6]:port (e.g. db.internal:5432), one port per entry"


class PrivateHostError(ValueError):
    """An `egress_private_hosts` entry that cannot be read; the message names it."""


def parse_private_host(entry: str) -> tuple[str, frozenset[int]]:
    """One entry: the normalized host and the ports it may reach a private address on."""
    text = entry.strip()
    if not text:
        raise PrivateHostError(f"an egress_private_hosts entry is empty; {_SYNTAX}")
    if address_of(text) is not None and ":" in text:
        # An IPv6 address without brackets: `fd00::1:8080` is an address too, so a port
        # written after one would be read as part of it. Only the bracketed form is taken.
        raise PrivateHostError(
            f"egress_private_hosts entry {entry[:80]!r} is an IPv6 address without brackets "
            f"(a port after it would read as part of the address); {_SYNTAX}"
        )
    try:
        host, port = split_authority(text)
    except BadTarget as exc:
        raise PrivateHostError(
            f"egress_private_hosts entry {entry[:80]!r}: {exc}; {_SYNTAX}"
        ) from None
    return host, BARE_NAME_PORTS if port is None else frozenset({port})


def parse_private_hosts(entries: Iterable[str]) -> Mapping[str, frozenset[int]]:
    """Every entry, by host: a host listed more than once may reach each port listed."""
    ports: dict[str, frozenset[int]] = {}
    for entry in entries:
        host, more = parse_private_host(entry)
        ports[host] = ports.get(host, frozenset()) | more
    return MappingProxyType(ports)
