"""What a sandbox can send the proxy without hurting the service: garbage, oversized or endless
heads, too many connections, more bytes than its cap, a client that stops reading; and the
byte-level behaviour of tunnels (early data, half-close)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox.egress.slots import ConnectionSlots
from tests.sandbox.egress.conftest import (
    HELLO,
    StartProxy,
    UpstreamServer,
    curl,
    overrides,
    raw_exchange,
)

MiB = 1 << 20


def allowed(upstream: UpstreamServer, *echo_ports: int, **settings: object) -> dict[str, object]:
    """The test names on loopback, each on the ports it is used on (private hosts name them)."""
    return {
        "resolve_overrides": overrides("allowed.test", "echo.test"),
        "private_hosts": frozenset(
            {f"allowed.test:{upstream.port}", *(f"echo.test:{port}" for port in echo_ports)}
        ),
        **settings,
    }


async def open_tunnel(
    relay_port: int, authority: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)),
            400,
        ),  # TLS, no CONNECT
        (b"\x00\xff\r\n\r\n", 400),
        (b"GET http://allowed.test/ HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (
            b"GET http://allowed.test/ HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            400,
        ),
        (b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n" + b"X: y\r\n" * 20000, 431),
    ],
)
async def test_garbage_and_oversized_heads_get_a_4xx_and_a_record(
    start_proxy: StartProxy, upstream: UpstreamServer, payload: bytes, status: int
) -> None:
    running = await start_proxy("any", **allowed(upstream))
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    writer.write(payload)
    writer.write_eof()
    async with asyncio.timeout(30):
        answer = await reader.read(-1)
    writer.close()
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"This is an HTTP proxy" in answer
    (record,) = await running.records(1)
    assert not record.allowed and record.bytes_up == record.bytes_down == 0


async def test_a_head_that_never_ends_times_out(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, header_timeout_s=1.0))
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    writer.write(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allo")
    async with asyncio.timeout(30):
        answer = await reader.read(-1)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 the request head did not arrive within 1 s")
    (record,) = await running.records(1)
    assert "did not arrive" in record.reason


async def test_garbage_in_bulk_leaves_the_proxy_serving_and_one_record_each(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, header_timeout_s=2.0))
    payloads = [os.urandom(n) for n in (1, 7, 100, 4096, 70000)] + [b"CONNECT \r\n\r\n"] * 5
    await asyncio.gather(*(raw_exchange(running.relay_port, p) for p in payloads))
    await running.records(len(payloads))
    code, out, err = await curl("-x", running.url, f"http://allowed.test:{upstream.port}/")
    assert code == 0, err
    assert out.encode() == HELLO
    records = await running.records(len(payloads) + 1)
    assert len(records) == len(payloads) + 1
    assert running.proxy.open_connections == 0


async def test_the_connection_cap_refuses_one_more_and_frees_on_close(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, max_connections_per_session=3))
    tunnels = [
        await open_tunnel(running.relay_port, f"allowed.test:{upstream.port}") for _ in "abc"
    ]
    over = await raw_exchange(
        running.relay_port, b"CONNECT allowed.test:1 HTTP/1.1\r\nHost: allowed.test:1\r\n\r\n"
    )
    assert over.startswith(
        b"HTTP/1.1 503 too many connections: this sandbox already has 3 connections open"
    )
    _, writer = tunnels.pop()
    writer.close()
    await running.records(2)  # the refused one and the closed tunnel
    reader, writer = await open_tunnel(running.relay_port, f"allowed.test:{upstream.port}")
    writer.write(b"GET /hello HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
    async with asyncio.timeout(30):
        assert (await reader.read(-1)).endswith(HELLO)
    for _, w in [*tunnels, (reader, writer)]:
        w.close()


async def test_each_shared_cap_says_it_is_the_one_reached(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    """Two sessions of one key and one of another, sharing the service's cap: the 503 names the
    session's, the key's or the service's cap, and a refusal holds no slot of any."""
    service = ConnectionSlots(3, "the service's cap, retry later")
    key_a, key_b = ConnectionSlots(2, "key A's cap, close some"), ConnectionSlots(9, "key B's")
    one = allowed(upstream, max_connections_per_session=1)
    first = await start_proxy("any", slots=(key_a, service), **one)
    second = await start_proxy("any", slots=(key_a, service), **allowed(upstream))
    other = await start_proxy("any", slots=(key_b, service), **allowed(upstream))
    authority = f"allowed.test:{upstream.port}"
    held = [await open_tunnel(first.relay_port, authority)]
    over = connect_request(authority)
    assert (await raw_exchange(first.relay_port, over)).startswith(
        b"HTTP/1.1 503 too many connections: this sandbox already has 1 connections open "
        b"through the proxy, the session's cap"
    )
    held.append(await open_tunnel(second.relay_port, authority))
    assert (await raw_exchange(second.relay_port, over)).startswith(
        b"HTTP/1.1 503 too many connections: key A's cap, close some"
    )
    held.append(await open_tunnel(other.relay_port, authority))  # another key still gets in
    assert (await raw_exchange(other.relay_port, over)).startswith(
        b"HTTP/1.1 503 too many connections: the service's cap, retry later"
    )
    assert (key_a.taken, key_b.taken, service.taken) == (2, 1, 3)
    for _, writer in held:
        writer.close()
    for running in (first, second, other):
        await running.records(2)
    assert (key_a.taken, key_b.taken, service.taken) == (0, 0, 0)


def connect_request(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


async def test_the_byte_cap_cuts_a_transfer_closes_open_tunnels_and_refuses_new_ones(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    cap = 1 * MiB
    running = await start_proxy("any", **allowed(upstream, max_bytes_per_session=cap))
    bystander_reader, bystander = await open_tunnel(
        running.relay_port, f"allowed.test:{upstream.port}"
    )
    reader, writer = await open_tunnel(running.relay_port, f"allowed.test:{upstream.port}")
    writer.write(f"GET /big?n={8 * MiB} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
    async with asyncio.timeout(60):
        received = await reader.read(-1)
        assert await bystander_reader.read(-1) == b""  # the idle tunnel was closed too
    assert 0 < len(received) < cap
    writer.close()
    bystander.close()
    records = await running.records(2)
    assert running.ledger.bytes_used == cap
    assert sum(r.bytes_up + r.bytes_down for r in records) == cap
    assert all("byte cap of 1048576 bytes is used up" in r.reason for r in records)
    _, out, _ = await curl("-i", "-x", running.url, f"http://allowed.test:{upstream.port}/")
    assert out.startswith("HTTP/1.1 403 the session's egress byte cap of 1048576 bytes is used up")


async def test_the_byte_cap_holds_for_plain_http_too(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, max_bytes_per_session=MiB))
    code, out, _ = await curl(
        "-x", running.url, f"http://allowed.test:{upstream.port}/big?n={4 * MiB}"
    )
    assert code != 0  # the transfer was cut
    assert len(out) < MiB
    (record,) = await running.records(1)
    assert running.ledger.bytes_used == MiB and "byte cap" in record.reason


async def test_a_client_that_stops_reading_is_closed_and_memory_stays_bounded(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, idle_timeout_s=2.0))
    _, writer = await open_tunnel(running.relay_port, f"allowed.test:{upstream.port}")
    writer.write(f"GET /big?n={1 << 30} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
    await writer.drain()
    (record,) = await running.records(1, within_s=60)  # never reading a byte
    assert "no byte either way" in record.reason
    assert record.bytes_down < 64 * MiB  # what the socket buffers hold, not the gigabyte
    writer.close()


@pytest.fixture
async def echo_after_eof() -> AsyncIterator[int]:
    """A destination that answers only once the client has finished sending (half-close)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read(-1)
        writer.write(b"got %d bytes" % len(data))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_a_half_close_goes_through_and_the_answer_comes_back(
    start_proxy: StartProxy, upstream: UpstreamServer, echo_after_eof: int
) -> None:
    running = await start_proxy("any", **allowed(upstream, echo_after_eof))
    reader, writer = await open_tunnel(running.relay_port, f"echo.test:{echo_after_eof}")
    writer.write(b"z" * 300_000)
    writer.write_eof()
    async with asyncio.timeout(30):
        assert await reader.read(-1) == b"got 300000 bytes"
    writer.close()
    (record,) = await running.records(1)
    assert record.bytes_up == 300_000 and record.bytes_down == len(b"got 300000 bytes")


async def test_bytes_sent_right_after_connect_reach_the_destination(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    """A client that does not wait for the 200 (h11's trailing data) loses nothing."""
    running = await start_proxy("any", **allowed(upstream))
    authority = f"allowed.test:{upstream.port}"
    answer = await raw_exchange(
        running.relay_port,
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        "GET /hello HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n".encode(),
    )
    assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 OK")
    assert answer.endswith(HELLO)


async def test_a_refused_upload_still_reads_the_403(
    start_proxy: StartProxy, upstream: UpstreamServer, tmp_path: Path
) -> None:
    """A client still uploading a body when it is refused reads the 403 all the same."""
    running = await start_proxy(["pypi.org"], **allowed(upstream))
    body = tmp_path / "body"
    body.write_bytes(b"u" * (512 * 1024))
    code, out, err = await curl(
        "-i", "-x", running.url, "--data-binary", f"@{body}", "-H", "Expect:",
        f"http://allowed.test:{upstream.port}/echo",
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith("HTTP/1.1 403 egress refused")


async def test_a_body_that_stalls_is_closed_after_the_idle_time(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream, idle_timeout_s=2.0))
    _, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    writer.write(
        f"POST http://allowed.test:{upstream.port}/echo HTTP/1.1\r\n"
        f"Host: allowed.test:{upstream.port}\r\nContent-Length: 100\r\n\r\nonly ten..".encode()
    )
    (record,) = await running.records(1, within_s=60)
    assert record.allowed and "no byte either way" in record.reason
    writer.close()


@pytest.fixture
async def close_delimited() -> AsyncIterator[int]:
    """A destination answering the old way: no length, the end of the body is the close."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"old " * 5000)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_a_close_delimited_response_is_relayed_whole(
    start_proxy: StartProxy, upstream: UpstreamServer, close_delimited: int
) -> None:
    running = await start_proxy("any", **allowed(upstream, close_delimited))
    code, out, err = await curl("-x", running.url, f"http://echo.test:{close_delimited}/")
    assert code == 0, err
    assert out == "old " * 5000
