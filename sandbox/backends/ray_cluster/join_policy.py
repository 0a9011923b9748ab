"""Whether a replica may join a Ray cluster at that address without Ray's token authentication.

Whoever can call a Ray cluster runs code on every node of it, every tenant's sessions
included (docs/cluster.md, "Securing the cluster"). A cluster on this machine's loopback is
reached only from here; one at any other address is reached over a network, so the replica
joins it only with `RAY_AUTH_MODE=token` in its environment (Ray then sends, and every Ray
process of the cluster demands, the token), unless the operator said, with the backend option
`allow_unauthenticated`, that the network is theirs alone. Pure: no Ray is imported here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from code_interpreter_wire.errors import BackendUnavailable

AUTH_MODE_ENV = "RAY_AUTH_MODE"
# `ray.init` addresses that name a cluster on this machine, not a host.
_LOCAL_ADDRESSES = ("auto", "local")


def address_host(address: str) -> str:
    """The host of a Ray address (`host:port`, `ray://host:port`, `[v6]:port`)."""
    rest = address.strip()
    if "://" in rest:
        rest = rest.split("://", 1)[1]
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    if rest.count(":") > 1:  # a bare IPv6 address, no port
        return rest
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def is_loopback(address: str) -> bool:
    """Whether the address is this machine's loopback (or names a cluster on this machine)."""
    if address.strip().lower() in _LOCAL_ADDRESSES:
        return True
    host = address_host(address).lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_join(address: str, env: Mapping[str, str], *, allow_unauthenticated: bool) -> None:
    """Refuse (`BackendUnavailable`) to join a cluster across a network without token auth."""
    if allow_unauthenticated or is_loopback(address):
        return
    mode = env.get(AUTH_MODE_ENV, "").strip().lower()
    if mode == "token":
        return
    raise BackendUnavailable(
        f"refusing to join the Ray cluster at {address!r} without authentication: whoever "
        "reaches an open Ray cluster runs code on its nodes and in every session. Run every Ray "
        f"process and this service with {AUTH_MODE_ENV}=token and the cluster's RAY_AUTH_TOKEN "
        f"(now {AUTH_MODE_ENV}={mode or 'unset'}); see docs/cluster.md, 'Securing the "
        "cluster'. Only on a private network you alone control, turn this check off instead "
        "(the service's setting CODE_INTERPRETER_RAY_ALLOW_UNAUTHENTICATED=true; the ray "
        "backend's option allow_unauthenticated=True when embedded)."
    )
