"""A byte stream to a port inside a sandbox (sandbox/port_relay.py), on every backend: binary
data both ways, half-closes, a port nothing listens on, and no relay left behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from code_interpreter_wire.errors import PortUnreachable
from sandbox import Sandbox
from sandbox.port_relay import PortStream, open_port
from tests.conftest import host_processes_with

# An echo server in the kernel: each connection's bytes back, then its end passed on.
ECHO_SERVER = """
import socket, threading
def _serve(listener):
    while True:
        conn, _ = listener.accept()
        def echo(conn=conn):
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)
        threading.Thread(target=echo, daemon=True).start()
_listener = socket.create_server(("127.0.0.1", {port}))
threading.Thread(target=_serve, args=(_listener,), daemon=True).start()
"""


async def read_all(stream: PortStream) -> bytes:
    got = bytearray()
    while chunk := await stream.read(1 << 16):
        got += chunk
    return bytes(got)


async def test_bytes_go_both_ways_through_a_relay(sandbox: Sandbox) -> None:
    started = await sandbox.execute(ECHO_SERVER.format(port=8765))
    assert started.ok, started.error
    payload = os.urandom(300_000) + bytes(range(256))  # every byte value, more than a chunk
    stream = await open_port(sandbox.spawner(), 8765)
    try:
        writing = asyncio.ensure_future(_write_then_end(stream, payload))
        assert await asyncio.wait_for(read_all(stream), 60) == payload
        await writing
    finally:
        await stream.close()
    # Two at once, apart.
    first, second = await asyncio.gather(*(open_port(sandbox.spawner(), 8765) for _ in range(2)))
    try:
        await first.write(b"one")
        await second.write(b"two")
        await first.write_eof()
        await second.write_eof()
        assert await read_all(first) == b"one"
        assert await read_all(second) == b"two"
    finally:
        await first.close()
        await second.close()


async def _write_then_end(stream: PortStream, payload: bytes) -> None:
    for start in range(0, len(payload), 50_000):
        await stream.write(payload[start : start + 50_000])
    await stream.write_eof()


async def test_a_port_nothing_listens_on_is_unreachable_and_says_so(sandbox: Sandbox) -> None:
    with pytest.raises(PortUnreachable, match="nothing answers on port 8799"):
        await open_port(sandbox.spawner(), 8799)
    with pytest.raises(PortUnreachable, match="not a TCP port"):
        await open_port(sandbox.spawner(), 70000)


async def test_a_closed_stream_leaves_no_relay(sandbox: Sandbox) -> None:
    started = await sandbox.execute(ECHO_SERVER.format(port=8766))
    assert started.ok, started.error
    stream = await open_port(sandbox.spawner(), 8766)
    await stream.write(b"x")
    assert await stream.read(10) == b"x"
    assert host_processes_with("sandbox/port_relay.py starts it")  # (its source is its argv)
    await stream.close()
    assert not host_processes_with("sandbox/port_relay.py starts it")
    # The server lives on: another connection is served.
    again = await open_port(sandbox.spawner(), 8766)
    try:
        await again.write(b"y")
        assert await again.read(10) == b"y"
    finally:
        await again.close()
