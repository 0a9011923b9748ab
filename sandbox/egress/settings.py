"""What the operator tunes about the egress proxy, one deployment at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from code_interpreter_wire.network_policy import normalize_host
from sandbox.egress.private_hosts import parse_private_hosts


def _no_overrides() -> Mapping[str, tuple[str, ...]]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ServiceEndpoint:
    """A listener no sandbox may reach through the proxy, whatever name leads there and
    whatever the operator allowed: the service's own API, the store holding its keys.

    `host` is as configured: an address, a name (looked up when a connection is checked), or
    the unspecified address (`0.0.0.0`, `::`: the port is refused on every address)."""

    what: str  # named in the refusal, e.g. "the service's own API"
    host: str
    port: int


@dataclass(frozen=True)
class EgressSettings:
    """Limits and exceptions of the egress proxy.

    `private_hosts` is the only way to reach a private, loopback or link-local address: an
    entry `host:port` (or a bare host: ports 80 and 443) lets that name (or IP literal) resolve
    to one on that port (`private_ports` holds them read). `resolve_overrides` only answers name
    lookups without DNS (tests, fixed hosts); it grants nothing, so a name mapped to 127.0.0.1
    there is still refused unless it is in `private_hosts` too. Keeping the two apart is what
    lets a test prove that a name resolving to loopback is refused. `refused_endpoints` are
    refused on every address that leads to them, private hosts included.
    """

    private_hosts: frozenset[str] = frozenset()
    refused_endpoints: tuple[ServiceEndpoint, ...] = ()
    resolve_overrides: Mapping[str, tuple[str, ...]] = field(default_factory=_no_overrides)
    max_bytes_per_session: int = 1 << 30  # up + down; past it, tunnels close, new ones get 403
    max_connections_per_session: int = 64  # open at once
    connect_timeout_s: float = 10.0  # per address dialled, and for the name lookup
    header_timeout_s: float = 20.0  # a client that never finishes its request head
    idle_timeout_s: float = 300.0  # a connection with no byte either way
    max_head_bytes: int = 64 * 1024  # a longer request head (or response head) is refused
    # CA certificates trusted beside the system's when the proxy itself speaks TLS to a host
    # (credential substitution, sandbox/egress/interception.py): an internal CA, or tests'.
    upstream_ca_file: Path | None = None
    # The CONNECT ports whose TLS the proxy inspects for a session with secrets when no secret
    # is bound to the host: the placeholders it carries are noted (sent unchanged); empty, such
    # tunnels stay opaque (sandbox/egress/exchange.py, docs/secrets.md).
    inspected_ports: frozenset[int] = frozenset({443})
    private_ports: Mapping[str, frozenset[int]] = field(init=False)

    def __post_init__(self) -> None:
        # Compared with normalized destination names, so read and normalized here once
        # (PrivateHostError naming a bad entry).
        object.__setattr__(self, "private_ports", parse_private_hosts(self.private_hosts))
        overrides = {
            normalize_host(name): tuple(addresses)
            for name, addresses in self.resolve_overrides.items()
        }
        object.__setattr__(self, "resolve_overrides", MappingProxyType(overrides))
        if self.max_bytes_per_session < 0 or self.max_connections_per_session < 1:
            raise ValueError("egress caps must be positive")
