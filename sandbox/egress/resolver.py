"""Names to the addresses the proxy will dial: looked up by the proxy itself (or taken from
the settings' overrides), then checked, so the address checked is the address dialled and a
name cannot be re-resolved to somewhere else in between (DNS rebinding)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor

from code_interpreter_wire.network_policy import IpAddress
from sandbox.egress.address_guard import why_not_public
from sandbox.egress.settings import EgressSettings

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
    """The checked addresses of a normalized host, in the order to try them: public ones, or
    any for a private host on a port the operator named with it."""
    addresses = await lookup(host, port, settings)
    private_ports = settings.private_ports.get(host)
    if private_ports is not None and port in private_ports:
        return addresses
    for address in addresses:
        why = why_not_public(address)
        if why is None:
            continue
        shown = host if str(address) == host else f"{host} resolves to {address},"
        if private_ports is None:
            hint = "an operator may allow a name to reach a private address with private_hosts"
        else:
            named = ", ".join(str(p) for p in sorted(private_ports))
            ports = "port" if len(private_ports) == 1 else "ports"
            hint = (
                f"private_hosts lets {host} reach a private address on {ports} {named} only, "
                f"not {port}; an operator may add {host}:{port} to private_hosts"
            )
        raise Unreachable(403, f"{shown} {why}; the proxy reaches only public addresses ({hint})")
    return addresses


async def lookup(host: str, port: int, settings: EgressSettings) -> tuple[IpAddress, ...]:
    """The addresses of a host: itself if an address, the settings' override, else DNS (on
    threads of its own, within the connect timeout); `Unreachable` (502) when it has none."""
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
