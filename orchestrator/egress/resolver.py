"""Names to the addresses the proxy will dial: looked up by the proxy itself (or taken from
the settings' overrides), then checked, so the address checked is the address dialled and a
name cannot be re-resolved to somewhere else in between (DNS rebinding)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor

from orchestrator.egress.address_guard import why_not_public
from orchestrator.egress.settings import EgressSettings
from sandbox.network_policy import IpAddress

# Name lookups block a thread each, and a slow resolver is not stopped by a timeout: on threads
# of their own, few, so lookups can hold up only other lookups, never the service's shared pool.
_LOOKUPS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="egress-dns")


class Unreachable(Exception):
    """A destination the proxy will not or cannot dial; `status` is the HTTP answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def resolve(host: str, port: int, settings: EgressSettings) -> tuple[IpAddress, ...]:
    """The checked addresses of a normalized host, in the order to try them."""
    addresses = await _lookup(host, port, settings)
    if host not in settings.private_hosts:
        for address in addresses:
            why = why_not_public(address)
            if why is not None:
                shown = host if str(address) == host else f"{host} resolves to {address},"
                raise Unreachable(
                    403,
                    f"{shown} {why}; the proxy reaches only public addresses (an operator "
                    "may allow a name to reach a private address with private_hosts)",
                )
    return addresses


async def _lookup(host: str, port: int, settings: EgressSettings) -> tuple[IpAddress, ...]:
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    fixed = settings.resolve_overrides.get(host)
    if fixed is not None:
        return tuple(dict.fromkeys(ipaddress.ip_address(a) for a in fixed))
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(settings.connect_timeout_s):
            infos = await loop.run_in_executor(
                _LOOKUPS, functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
            )
    except TimeoutError:
        raise Unreachable(
            502, f"looking up {host} took over {settings.connect_timeout_s:g} s"
        ) from None
    except OSError as exc:
        raise Unreachable(502, f"could not resolve {host}: {exc}") from None
    found = tuple(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    if not found:
        raise Unreachable(502, f"{host} has no address")
    return found
