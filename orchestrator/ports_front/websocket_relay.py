"""A WebSocket carried to a server in a sandbox: the client's handshake spoken again to the
server (websockets' sans-I/O client over the relay's stream), then each message passed on as
it comes, both ways, until either side closes. Messages are capped (a larger one closes the
socket with 1009); pings are answered on each side by its own protocol.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response as HandshakeResponse
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from orchestrator.ports_front.caller import HOP_BY_HOP, onward_headers
from orchestrator.service_parts.ports import PortConnection

# A message's most, both ways: the service's own WebSocket server takes no more from a client
# (http_server.py's ws_max_size); a larger one closes the socket with 1009.
MAX_MESSAGE_BYTES = 1 << 20
_CHUNK = 64 * 1024
_HANDSHAKE_TIMEOUT_S = 30.0
# Set by either protocol itself, never copied from the client's request.
_OWN_HEADERS = frozenset(
    {
        "host",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "content-length",
    }
)


class HandshakeRefused(Exception):
    """The server in the sandbox did not take the WebSocket (the message says what it said)."""


async def _flush(protocol: ClientProtocol, connection: PortConnection) -> None:
    for data in protocol.data_to_send():
        if data:
            await connection.write(data)
        else:  # the protocol is done sending: half-close
            await connection.write_eof()


async def open_upstream(
    websocket: WebSocket, connection: PortConnection, target: str, host: str, *, path_form: bool
) -> tuple[ClientProtocol, str | None, list[Frame]]:
    """Do the server's handshake for the client's: the protocol, the subprotocol agreed, and
    the frames that came with the handshake's answer (a server that greets on open).
    HandshakeRefused if the server answers anything but a switch to WebSocket."""
    asked = [
        Subprotocol(p.strip())
        for value in websocket.headers.getlist("sec-websocket-protocol")
        for p in value.split(",")
        if p.strip()
    ]
    protocol = ClientProtocol(
        parse_uri(f"ws://{host}{target}"), subprotocols=asked or None, max_size=MAX_MESSAGE_BYTES
    )
    request = protocol.connect()
    for name, value in onward_headers(websocket, path_form=path_form):
        text = name.decode("latin-1").lower()
        if text not in _OWN_HEADERS and text not in HOP_BY_HOP:
            request.headers[name.decode("latin-1")] = value.decode("latin-1")
    protocol.send_request(request)
    await _flush(protocol, connection)
    async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
        while True:
            data = await connection.read(_CHUNK)
            if data:
                protocol.receive_data(data)
            else:
                protocol.receive_eof()
            events = protocol.events_received()
            for number, event in enumerate(events):
                if isinstance(event, HandshakeResponse):
                    if protocol.handshake_exc is not None:
                        raise HandshakeRefused(_said(event, protocol.handshake_exc))
                    early = [e for e in events[number + 1 :] if isinstance(e, Frame)]
                    return protocol, event.headers.get("Sec-WebSocket-Protocol"), early
            if not data:
                raise HandshakeRefused("the server closed the connection before answering")


def _said(response: HandshakeResponse, error: Exception) -> str:
    return f"the server answered {response.status_code} {response.reason_phrase}: {error}"


async def relay_messages(
    websocket: WebSocket,
    protocol: ClientProtocol,
    connection: PortConnection,
    early: list[Frame],
) -> None:
    """Pass messages both ways until one side closes; the other is then closed alike.
    `early`: the server's frames that came with its handshake, passed on first."""
    upstream = asyncio.ensure_future(_client_to_server(websocket, protocol, connection))
    downstream = asyncio.ensure_future(_server_to_client(websocket, protocol, connection, early))
    try:
        await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (upstream, downstream):
            task.cancel()
        for task in (upstream, downstream):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await websocket.close()


async def _client_to_server(
    websocket: WebSocket, protocol: ClientProtocol, connection: PortConnection
) -> None:
    while True:
        try:
            message = await websocket.receive()
        except WebSocketDisconnect:
            message = {"type": "websocket.disconnect", "code": 1000}
        if message["type"] == "websocket.disconnect":
            with contextlib.suppress(Exception):
                protocol.send_close(_sendable_code(message.get("code")))
                await _flush(protocol, connection)
            return
        text, data = message.get("text"), message.get("bytes")
        if text is not None:
            protocol.send_text(text.encode())
        elif data is not None:
            protocol.send_binary(data)
        await _flush(protocol, connection)


def _sendable_code(code: object) -> int:
    """A close code one may send (1005/1006 are only ever reported, never sent)."""
    return code if isinstance(code, int) and code not in (1005, 1006, 1015) else 1000


async def _server_to_client(
    websocket: WebSocket, protocol: ClientProtocol, connection: PortConnection, early: list[Frame]
) -> None:
    parts: list[bytes] = []
    kind: Opcode | None = None
    pending: list[Frame] = list(early)
    data = b"-"  # the early frames are handled before anything is read
    while True:
        if not pending:
            data = await connection.read(_CHUNK)
            if data:
                protocol.receive_data(data)
            else:
                protocol.receive_eof()
            pending = [e for e in protocol.events_received() if isinstance(e, Frame)]
        frames, pending = pending, []
        for frame in frames:
            if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                kind, parts = frame.opcode, [bytes(frame.data)]
            elif frame.opcode is Opcode.CONT:
                parts.append(bytes(frame.data))
            elif frame.opcode is Opcode.CLOSE:
                await _flush(protocol, connection)  # its close answered
                code = protocol.close_rcvd.code if protocol.close_rcvd else 1000
                reason = protocol.close_rcvd.reason if protocol.close_rcvd else ""
                await websocket.close(_sendable_code(code), reason)
                return
            else:  # a ping: answered in data_to_send below; a pong: nothing to do
                continue
            if frame.fin and kind is not None:
                whole = b"".join(parts)
                parts, kind_now, kind = [], kind, None
                if kind_now is Opcode.TEXT:
                    try:
                        text = whole.decode("utf-8")
                    except UnicodeDecodeError:
                        await websocket.close(1007, "the server sent text that is not UTF-8")
                        return
                    await websocket.send_text(text)
                else:
                    await websocket.send_bytes(whole)
        await _flush(protocol, connection)
        if protocol.parser_exc is not None:  # a message over the cap, or a broken frame
            code = protocol.close_sent.code if protocol.close_sent is not None else 1002
            await websocket.close(_sendable_code(code), str(protocol.parser_exc)[:120])
            return
        if not data:
            await websocket.close(1011, "the server in the sandbox closed the connection")
            return
