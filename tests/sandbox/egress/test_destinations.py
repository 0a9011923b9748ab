"""Where the proxy refuses to go, whatever the name says: names resolving to loopback or the
metadata address, IP literals in every spelling, refused ports, a Host header that disagrees,
the ceiling. A listener on the host's loopback checks that nothing was ever dialled."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from tests.sandbox.egress.conftest import (
    HELLO,
    StartProxy,
    UpstreamServer,
    curl,
    overrides,
    raw_exchange,
)


def split(response: bytes) -> tuple[str, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body.decode()


def get(url: str, host: str | None = None) -> bytes:
    authority = host if host is not None else url.split("/")[2]
    return f"GET {url} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def connect(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


@pytest.mark.parametrize(
    ("name", "address", "why"),
    [
        ("rebind.test", "127.0.0.1", "a loopback address"),
        ("metadata.test", "169.254.169.254", "the cloud metadata address"),
        ("private.test", "10.1.2.3", "a private address"),
        ("shared.test", "100.64.0.9", "a shared (carrier-grade NAT) address"),
        ("mapped.test", "::ffff:127.0.0.1", "a loopback address in IPv6 form"),
        ("v6loop.test", "::1", "a loopback address"),
        # Global by Python 3.11's tables, not routed on the internet: refused before any dial.
        ("sitelocal.test", "fec0::1", "a site-local address (fec0::/10, deprecated)"),
        ("sixbone.test", "3ffe:b00::1", "a 6bone address (3ffe::/16, returned)"),
    ],
)
async def test_a_name_resolving_to_a_non_public_address_is_refused(
    start_proxy: StartProxy, host_listener: int, name: str, address: str, why: str
) -> None:
    """The resolver override maps the name, but only private_hosts grants private addresses."""
    running = await start_proxy("any", resolve_overrides=overrides(name, to=address))
    for request in (get(f"http://{name}:{host_listener}/"), connect(f"{name}:{host_listener}")):
        status, body = split(await raw_exchange(running.relay_port, request))
        assert status.startswith("HTTP/1.1 403 egress refused:"), status
        assert f"{name} resolves to {ipaddress.ip_address(address)}, {why}" in body
        assert "private_hosts" in body
    records = await running.records(2)
    assert all(not r.allowed and r.address is None and r.bytes_up == 0 for r in records)


async def test_one_non_public_address_among_public_ones_refuses_the_name(
    start_proxy: StartProxy, host_listener: int
) -> None:
    # A public address first; refused before any dial, so it is never contacted.
    running = await start_proxy(
        "any", resolve_overrides={"mixed.test": ("93.184.216.34", "127.0.0.1")}
    )
    status, body = split(
        await raw_exchange(running.relay_port, connect(f"mixed.test:{host_listener}"))
    )
    assert status.startswith("HTTP/1.1 403")
    assert "resolves to 127.0.0.1, a loopback address" in body


async def test_localhost_through_the_real_resolver_is_refused(
    start_proxy: StartProxy, host_listener: int
) -> None:
    running = await start_proxy("any")
    status, body = split(
        await raw_exchange(running.relay_port, get(f"http://localhost:{host_listener}/"))
    )
    assert status.startswith("HTTP/1.1 403")
    assert "localhost resolves to" in body and "loopback" in body


@pytest.mark.parametrize(
    ("host", "phrase"),
    [
        ("127.0.0.1", "is an IP address"),
        ("[::1]", "is an IP address"),
        ("[::ffff:127.0.0.1]", "is an IP address"),
        ("[::ffff:7f00:1]", "is an IP address"),
        ("169.254.169.254", "is an IP address"),
        ("2130706433", "is a number, not a host name"),
        ("0x7f.1", "is a number, not a host name"),
        ("127.1", "is a number, not a host name"),
        ("0177.0.0.1", "is a number, not a host name"),
    ],
)
async def test_ip_literals_and_numeric_names_need_an_address_rule(
    start_proxy: StartProxy, host_listener: int, host: str, phrase: str
) -> None:
    """Not even 'any' reaches an address: only an address rule of the policy could."""
    running = await start_proxy("any")
    for request in (get(f"http://{host}:{host_listener}/"), connect(f"{host}:{host_listener}")):
        status, body = split(await raw_exchange(running.relay_port, request))
        assert status.startswith("HTTP/1.1 403"), (host, status)
        assert phrase in body, body


async def test_an_address_rule_still_does_not_reach_loopback(
    start_proxy: StartProxy, host_listener: int
) -> None:
    running = await start_proxy(
        {"allow": [{"host": "127.0.0.0/8", "ports": [host_listener]}, "::1"]}
    )
    status, body = split(
        await raw_exchange(running.relay_port, get(f"http://127.0.0.1:{host_listener}/"))
    )
    assert status.startswith("HTTP/1.1 403")
    assert "127.0.0.1 a loopback address" in body


async def test_an_operator_may_allow_a_private_address_by_name(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy(
        {"allow": [{"host": "127.0.0.1", "ports": [upstream.port]}]},
        private_hosts=frozenset({f"127.0.0.1:{upstream.port}"}),
    )
    code, out, err = await curl("-x", running.url, f"http://127.0.0.1:{upstream.port}/")
    assert code == 0, err
    assert out.encode() == HELLO


async def test_connect_to_a_refused_port_of_an_allowed_host(
    start_proxy: StartProxy, upstream: UpstreamServer, host_listener: int
) -> None:
    running = await start_proxy(
        [f"allowed.test:{upstream.port}"],
        resolve_overrides=overrides("allowed.test"),
        private_hosts=frozenset({f"allowed.test:{upstream.port}"}),
    )
    status, body = split(
        await raw_exchange(running.relay_port, connect(f"allowed.test:{host_listener}"))
    )
    assert status.startswith(f"HTTP/1.1 403 egress refused: allowed.test:{host_listener} is not")
    assert f"is not in the allow-list (allowed.test:{upstream.port})" in body


@pytest.mark.parametrize(
    "host_header", ["refused.test", "allowed.test:1", "127.0.0.1", "allowed.test:80", "a b"]
)
async def test_a_host_header_that_disagrees_with_the_url_is_refused(
    start_proxy: StartProxy, upstream: UpstreamServer, host_header: str
) -> None:
    running = await start_proxy(
        [f"allowed.test:{upstream.port}"],
        resolve_overrides=overrides("allowed.test"),
        private_hosts=frozenset({f"allowed.test:{upstream.port}"}),
    )
    request = get(f"http://allowed.test:{upstream.port}/", host=host_header)
    status, body = split(await raw_exchange(running.relay_port, request))
    assert status.startswith("HTTP/1.1 403") or status.startswith("HTTP/1.1 400"), status
    assert "Host header" in body
    (record,) = await running.records(1)
    assert not record.allowed and record.bytes_up == 0


async def test_a_matching_host_header_with_default_port_is_fine(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy(
        [f"allowed.test:{upstream.port}"],
        resolve_overrides=overrides("allowed.test"),
        private_hosts=frozenset({f"allowed.test:{upstream.port}"}),
    )
    request = get(f"http://ALLOWED.test.:{upstream.port}/", host=f"allowed.test:{upstream.port}")
    status, body = split(await raw_exchange(running.relay_port, request))
    assert status == "HTTP/1.1 200 OK"
    assert body.encode() == HELLO


@pytest.mark.parametrize(
    ("request_bytes", "status", "phrase"),
    [
        (b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 400, "this is an HTTP proxy"),
        (b"GET https://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 400, "CONNECT"),
        (b"CONNECT allowed.test HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 400, "needs a port"),
        (b"CONNECT allowed.test:0 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "port must be"),
        (b"GET http://u:p@allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 400, "user"),
        (b"GET http://bad_host!/ HTTP/1.1\r\nHost: bad_host!\r\n\r\n", 400, "not a host name"),
    ],
)
async def test_requests_the_proxy_cannot_route_get_a_400_saying_why(
    start_proxy: StartProxy, request_bytes: bytes, status: int, phrase: str
) -> None:
    running = await start_proxy("any", resolve_overrides=overrides("allowed.test"))
    line, body = split(await raw_exchange(running.relay_port, request_bytes))
    assert line.startswith(f"HTTP/1.1 {status}"), line
    assert phrase in body, body
    (record,) = await running.records(1)
    assert not record.allowed


async def test_the_ceiling_refuses_what_the_policy_allows(
    start_proxy: StartProxy, host_listener: int
) -> None:
    running = await start_proxy(
        "any",
        ceiling=NetworkPolicy.model_validate(["pypi.org"]),
        resolve_overrides=overrides("elsewhere.test", to="203.0.113.5"),
    )
    status, body = split(
        await raw_exchange(running.relay_port, connect(f"elsewhere.test:{host_listener}"))
    )
    assert status.startswith("HTTP/1.1 403")
    assert "beyond this deployment's ceiling" in body and "pypi.org:80,443" in body


async def test_a_deny_rule_wins(start_proxy: StartProxy, host_listener: int) -> None:
    running = await start_proxy(
        {"mode": "any", "deny": ["*.blocked.test"]},
        resolve_overrides=overrides("x.blocked.test", to="203.0.113.5"),
    )
    status, body = split(await raw_exchange(running.relay_port, connect("x.blocked.test:443")))
    assert status.startswith("HTTP/1.1 403")
    assert "matches the deny rule *.blocked.test" in body


@pytest.mark.parametrize("owner", ["policy", "ceiling"])
async def test_an_address_deny_rule_holds_for_names_resolving_into_it(
    start_proxy: StartProxy, host_listener: int, owner: str
) -> None:
    """E2B's deny_out lists networks: a name pointing into one is refused as its address is.
    The name may reach loopback (private_hosts), so only the deny rule stands in the way."""
    denied = {"mode": "any", "deny": ["127.0.0.0/8:*"]}
    running = await start_proxy(
        denied if owner == "policy" else "any",
        ceiling=NetworkPolicy.model_validate(denied if owner == "ceiling" else "any"),
        resolve_overrides=overrides("inside.test"),
        private_hosts=frozenset({f"inside.test:{host_listener}"}),
    )
    request = connect(f"inside.test:{host_listener}")
    status, body = split(await raw_exchange(running.relay_port, request))
    assert status.startswith("HTTP/1.1 403"), status
    assert f"the {owner}'s deny rule 127.0.0.0/8:*" in body, body
    (record,) = await running.records(1)
    assert not record.allowed


async def test_an_allowed_destination_that_does_not_answer_is_a_502(
    start_proxy: StartProxy,
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    running = await start_proxy(
        "any",
        resolve_overrides=overrides("down.test"),
        private_hosts=frozenset({f"down.test:{port}"}),
    )
    status, body = split(await raw_exchange(running.relay_port, connect(f"down.test:{port}")))
    assert status.startswith("HTTP/1.1 502 could not connect to down.test")
    assert "127.0.0.1" in body
    (record,) = await running.records(1)
    assert not record.allowed and record.address == "127.0.0.1"
