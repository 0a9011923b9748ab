"""The points of uvicorn's h11 protocol that orchestrator/http_server.py hooks into are still
there and still mean what it takes them to mean: a real uvicorn serves a small app on loopback
through GuardedH11Protocol, and the test reads what the protocol tells the guard. An upgrade of
uvicorn that moves any of them fails here, not silently in production."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import h11
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from websockets.asyncio.client import connect

from orchestrator.caller_mark import EXTENSION, CallerMark, caller_proven
from orchestrator.connection_guard import ConnectionGuard, ConnectionLimits, Phase, Watched
from orchestrator.http_server import (
    GuardedH11Protocol,
    answer_at_once,
    guarded_protocol,
    listening_socket,
)

pytestmark = pytest.mark.unit

LIMITS = ConnectionLimits(
    header_timeout_s=30,
    body_min_rate=1,
    write_stall_timeout_s=30,
    max_per_address=100,
    max_total=100,
)
BIG = 16 << 20  # an answer no socket's buffers hold


class Recording(ConnectionGuard):
    """The real guard, keeping the protocols it admitted so the test can look at them."""

    def __init__(self) -> None:
        super().__init__(LIMITS)
        self.admitted: list[Watched] = []

    def admit(self, conn: Watched, host: str) -> object:  # type: ignore[override]
        self.admitted.append(conn)
        return super().admit(conn, host)

    def protocol(self, index: int = -1) -> GuardedH11Protocol:
        conn = self.admitted[index]
        assert isinstance(conn, GuardedH11Protocol)
        return conn

    def phase(self, conn: Watched) -> tuple[Phase, bool] | None:
        entry = self._entries.get(conn)
        return None if entry is None else (entry.phase, entry.proven)


@dataclass
class App:
    """Proves the caller of `/keyed` and of the WebSocket; `/big` answers 16 MiB at once."""

    arrived: asyncio.Event
    finish: asyncio.Event
    marks: list[object]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.marks.append((scope.get("extensions") or {}).get(EXTENSION, {}).get("mark"))
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            caller_proven(scope)
            await send({"type": "websocket.accept"})
            await self.finish.wait()
            await send({"type": "websocket.close", "code": 1000})
            return
        if scope["path"] == "/keyed":
            caller_proven(scope)
        self.arrived.set()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = b"x" * BIG if scope["path"] == "/big" else body
        length = [(b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": answer})


@dataclass
class Served:
    guard: Recording
    app: App
    port: int


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    guard = Recording()
    app = App(asyncio.Event(), asyncio.Event(), [])
    sock = listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, http=guarded_protocol(guard), lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await until(lambda: server.started)
    yield Served(guard, app, sock.getsockname()[1])
    app.finish.set()
    server.should_exit = True
    await task


async def until(condition: Callable[[], bool]) -> None:
    """Poll the protocol's state, which changes as the loop serves the connection."""
    async with asyncio.timeout(10):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


def test_the_hooked_methods_are_uvicorns_own() -> None:
    for name in ("connection_made", "connection_lost", "data_received", "on_response_complete"):
        assert name in vars(H11Protocol), name
    for name in ("pause_writing", "resume_writing", "handle_websocket_upgrade"):
        assert name in vars(H11Protocol), name


async def test_a_request_body_in_flight_and_its_mark(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"POST /keyed HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
    await served.app.arrived.wait()
    guard, protocol = served.guard, served.guard.protocol()
    await until(lambda: guard.phase(protocol) == (Phase.BODY, True))
    cycle = protocol.cycle
    assert isinstance(cycle, RequestResponseCycle)
    assert cycle.waiting_for_100_continue is False
    assert (cycle.response_started, cycle.response_complete) == (False, False)
    assert cycle.disconnected is False
    assert protocol.flow.read_paused is False
    assert protocol.conn.their_state is h11.SEND_BODY
    assert protocol.scope is cycle.scope
    assert isinstance(served.app.marks[0], CallerMark)
    writer.write(b"def")
    assert (await reader.readuntil(b"abcdef")).startswith(b"HTTP/1.1 200")
    await until(lambda: guard.phase(protocol) == (Phase.WAITING, True))
    assert cycle.response_complete and protocol.conn.our_state is h11.IDLE
    writer.write(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")  # a new request: not proven
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    assert guard.phase(protocol) == (Phase.WAITING, False)
    assert served.app.marks[1] is not served.app.marks[0]
    writer.close()
    await until(lambda: guard.phase(protocol) is None)


async def test_writing_paused_by_a_client_that_does_not_read(served: Served) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", served.port))
    try:
        sock.send(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        guard = served.guard
        await until(lambda: bool(guard.admitted) and guard.protocol() in guard._stalls)
        protocol = guard.protocol()
        assert protocol.flow.write_paused and protocol.unsent() > 0
    finally:
        sock.close()


async def test_a_websocket_upgrade_carries_the_mark(served: Served) -> None:
    async with connect(f"ws://127.0.0.1:{served.port}/socket"):
        guard = served.guard
        protocol = guard.protocol()
        await until(lambda: guard.phase(protocol) == (Phase.DETACHED, True))
        assert isinstance(served.app.marks[0], CallerMark) and protocol._upgraded
        served.app.finish.set()
    await until(lambda: protocol.is_gone())
    guard.sweep()
    assert guard.phase(protocol) is None


def nodelay(protocol: GuardedH11Protocol) -> int:
    sock = protocol.transport.get_extra_info("socket")
    return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


async def test_connections_answer_without_nagles_wait(served: Served) -> None:
    """An answer's writes go out at once (TCP_NODELAY): with Nagle's algorithm, the body waited
    for the client's delayed acknowledgement of the head, 40 ms on every request after a
    kept-alive connection's first. Set whether or not the listening socket names TCP."""
    _, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        await until(lambda: bool(served.guard.admitted))
        assert nodelay(served.guard.protocol()) == 1
    finally:
        writer.close()
    # A listening socket made without naming TCP (asyncio then leaves Nagle on): still set.
    bare = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    bare.bind(("127.0.0.1", 0))
    bare.listen()
    loop = asyncio.get_running_loop()
    made: list[asyncio.Transport] = []

    class Recorder(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            made.append(transport)

    server = await loop.create_server(Recorder, sock=bare)
    try:
        _, plain = await asyncio.open_connection(*bare.getsockname()[:2])
        await until(lambda: bool(made))
        sock = made[0].get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # asyncio's default
        answer_at_once(made[0])
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        plain.close()
    finally:
        server.close()
