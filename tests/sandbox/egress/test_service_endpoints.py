"""The service's own listeners and the ports of private hosts: a name the operator lets reach
private addresses opens only the ports named with it, and never the service's own port or its
store's, whatever the name resolves to. A loopback listener stands in for the service and
counts whoever connects: nothing may."""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from sandbox.egress import EgressSettings
from sandbox.egress.service_guard import service_refusal
from sandbox.egress.settings import ServiceEndpoint
from tests.sandbox.egress.conftest import HELLO, StartProxy, UpstreamServer, curl, raw_exchange
from tests.sandbox.egress.test_destinations import connect, get, split


@dataclass
class Listener:
    port: int
    accepted: list[str] = field(default_factory=list)


@pytest.fixture
async def service() -> AsyncIterator[Listener]:
    """A stand-in for the service's API on the host's loopback, recording every connection."""
    listener = Listener(0)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.accepted.append(str(writer.get_extra_info("peername")))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nservice")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    listener.port = server.sockets[0].getsockname()[1]
    yield listener
    server.close()
    await server.wait_closed()


def api_at(host: str, port: int) -> tuple[ServiceEndpoint, ...]:
    return (ServiceEndpoint("the service's own API", host, port),)


@pytest.mark.parametrize("spelled", ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.2"])
@pytest.mark.parametrize("listens_on", ["127.0.0.1", "0.0.0.0", "svc.test"])
async def test_a_private_host_never_reaches_the_services_own_port(
    start_proxy: StartProxy, service: Listener, spelled: str, listens_on: str
) -> None:
    """Even when the operator named that very port with the name: plain HTTP and CONNECT."""
    running = await start_proxy(
        "any",
        resolve_overrides={"inside.test": (spelled,), "svc.test": ("127.0.0.1",)},
        private_hosts=frozenset({f"inside.test:{service.port}"}),
        refused_endpoints=api_at(listens_on, service.port),
    )
    authority = f"inside.test:{service.port}"
    for request in (get(f"http://{authority}/v1/sessions"), connect(authority)):
        status, body = split(await raw_exchange(running.relay_port, request))
        assert status.startswith("HTTP/1.1 403 egress refused: inside.test resolves to"), status
        assert "the service's own API, which no sandbox may reach" in body, body
    records = await running.records(2)
    assert all(not r.allowed and r.address is None for r in records)
    assert "the service's own API" in records[0].reason
    assert service.accepted == []


async def test_a_private_host_reaches_only_the_ports_named_with_it(
    start_proxy: StartProxy, upstream: UpstreamServer, service: Listener
) -> None:
    """`inside.test:<upstream>` opens that port alone; a bare name means ports 80 and 443."""
    running = await start_proxy(
        "any",
        resolve_overrides={"inside.test": ("127.0.0.1",), "bare.test": ("127.0.0.1",)},
        private_hosts=frozenset({f"inside.test:{upstream.port}", "bare.test"}),
    )
    code, out, err = await curl("-x", running.url, f"http://inside.test:{upstream.port}/")
    assert (code, out.encode()) == (0, HELLO), err
    for authority, named in (
        (f"inside.test:{service.port}", f"on port {upstream.port} only"),
        (f"bare.test:{service.port}", "on ports 80, 443 only"),
    ):
        for request in (get(f"http://{authority}/console/login"), connect(authority)):
            status, body = split(await raw_exchange(running.relay_port, request))
            assert status.startswith("HTTP/1.1 403"), (authority, status)
            assert "a loopback address" in body and named in body, body
            assert f"may add {authority} to private_hosts" in body, body
    assert service.accepted == []


def own_addresses() -> list[str]:
    """This host's addresses other than loopback, as `ip` lists them (none in a bare netns)."""
    listed = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False)
    found = []
    for line in listed.stdout.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] in ("inet", "inet6"):
            address = ipaddress.ip_address(words[3].split("/")[0])
            if not (address.is_loopback or address.is_link_local):
                found.append(str(address))
    return found


@pytest.mark.parametrize(
    ("endpoint", "address", "port", "refused"),
    [
        # The API on 127.0.0.1:8000: every loopback or unspecified spelling of its port.
        (("127.0.0.1", 8000), "127.0.0.1", 8000, True),
        (("127.0.0.1", 8000), "127.9.9.9", 8000, True),
        (("127.0.0.1", 8000), "::1", 8000, True),
        (("127.0.0.1", 8000), "::ffff:127.0.0.1", 8000, True),
        (("127.0.0.1", 8000), "0.0.0.0", 8000, True),
        (("127.0.0.1", 8000), "::", 8000, True),
        (("127.0.0.1", 8000), "64:ff9b::7f00:1", 8000, True),
        (("127.0.0.1", 8000), "::7f00:1", 8000, True),  # IPv4-compatible
        (("127.0.0.1", 8000), "::ffff:0:7f00:1", 8000, True),  # SIIT-translated
        (("127.0.0.1", 8000), "127.0.0.1", 8001, False),
        (("127.0.0.1", 8000), "10.1.2.3", 8000, False),
        # Listening on every address: the port is refused on any.
        (("0.0.0.0", 8000), "203.0.113.9", 8000, True),
        (("::", 8000), "2001:db8::9", 8000, True),
        (("0.0.0.0", 8000), "203.0.113.9", 8001, False),
        # A store elsewhere, by address or by name.
        (("10.9.9.9", 6379), "10.9.9.9", 6379, True),
        (("10.9.9.9", 6379), "::ffff:10.9.9.9", 6379, True),
        (("10.9.9.9", 6379), "::a09:909", 6379, True),
        (("10.9.9.9", 6379), "10.9.9.8", 6379, False),
        (("store.test", 6379), "10.9.9.9", 6379, True),
        (("store.test", 6379), "10.9.9.8", 6379, False),
    ],
)
async def test_the_guard_decides_by_the_resolved_address(
    endpoint: tuple[str, int], address: str, port: int, refused: bool
) -> None:
    """The decision alone, nothing dialled."""
    settings = EgressSettings(
        resolve_overrides={"store.test": ("10.9.9.9",)},
        refused_endpoints=(ServiceEndpoint("the endpoint", *endpoint),),
    )
    resolved = ipaddress.ip_address(address)
    why = await service_refusal("x.test", resolved, port, settings)
    assert (why is not None) == refused, why
    if why is not None:
        assert why.startswith(f"x.test resolves to {resolved}, and port {port} there may be")


async def test_this_hosts_own_addresses_are_refused_on_the_services_port() -> None:
    mine = own_addresses()
    if not mine:
        pytest.skip("this host has no address but loopback and link-local")
    settings = EgressSettings(refused_endpoints=api_at("127.0.0.1", 8000))
    for address in mine:
        why = await service_refusal(address, ipaddress.ip_address(address), 8000, settings)
        assert why is not None and why.startswith(f"{address}:8000 may be the service's own API")
        assert await service_refusal(address, ipaddress.ip_address(address), 8001, settings) is None
