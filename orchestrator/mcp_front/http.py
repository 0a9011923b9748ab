"""The MCP server over streamable HTTP at /mcp, inside the service's own app.

The same bearer keys as the REST API guard it, and the caller's owner travels in the request's
scope to the tools, so one key never reaches another key's sessions. When a client ends its MCP
session (DELETE with its Mcp-Session-Id), the sandbox session behind it ends too. Each connection
belongs to the key that opened it. Connections, and the sessions MCP makes, that are never ended
expire after `mcp_idle_timeout_s` idle: one-shot clients seldom say goodbye.

Each connection is told to the service's `mcp_connections` when it opens (with its client's
`initialize` params), read at each request and forgotten when it ends: in cluster mode they are
shared, so a request through a replica that does not hold the connection continues it there
(adoption.py), and one that ended through another replica is refused here too. An approval asked
of a connection's user (elicitation) may be answered through another replica than the one that
asked: that one keeps the answer in the store, and the asking one hands it to its own transport
(`answers_elsewhere`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import HTTPException, Request
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.auth import Authenticator
from orchestrator.front_config import FrontConfig
from orchestrator.mcp_connections import MAX_ANSWER_BYTES, MAX_CLIENT_BYTES, McpConnection
from orchestrator.mcp_front import adoption
from orchestrator.mcp_front.server import (
    OWNER_SCOPE_KEY,
    ConnectionSessions,
    build_mcp_server,
)
from orchestrator.service import Service
from orchestrator.sessions import SessionError
from sandbox.json_depth import nests_deeper_than

MCP_PATH = "/mcp"
_CLIENT_DEPTH = 32  # an initialize's params nested deeper are not kept (not continued elsewhere)
ANSWER_POLL_S = 0.25  # how often a replica waiting for an answer looks for one sent elsewhere
REPLAY_S = 30.0  # the longest handing one such answer to this replica's transport may take
# Of the asking request's headers, those a replayed answer carries (the transport checks them).
_REPLAYED_HEADERS = {b"host", b"origin", b"mcp-protocol-version"}
log = logging.getLogger(__name__)


def _refusal(message: str, status: int) -> ASGIApp:
    """As the SDK's transport refuses: a JSON-RPC error without an id."""
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}}
    return JSONResponse(body, status_code=status)


class McpHttpFront:
    """An ASGI endpoint: authenticate, hand over to the MCP transport, end what the client ends."""

    def __init__(self, service: Service, authenticate: Authenticator, fronts: FrontConfig) -> None:
        self._service = service
        self._fronts = fronts
        self._authenticate = authenticate
        self.connections = ConnectionSessions(service)
        self._transport: StreamableHTTPASGIApp | None = None
        self._manager: StreamableHTTPSessionManager | None = None
        self._replica = secrets.token_hex(8)  # this process, to answers kept for it elsewhere
        self._relays: set[asyncio.Future[None]] = set()  # answers taken for questions asked here

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve while the service runs; the server is made once the service has started, so
        the tool's description can list the host tools (an MCP server's among them)."""
        fronts = self._fronts
        server, _ = await build_mcp_server(
            self._service, connections=self.connections, answers_elsewhere=self.answers_elsewhere
        )
        # Builds the session manager (with DNS-rebinding protection on a loopback host); the
        # Starlette app it returns is not used: this endpoint is mounted in ours instead.
        server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            host=fronts.host,
            session_idle_timeout=fronts.mcp_idle_timeout_s,
            max_request_body_size=fronts.max_request_bytes,
        )
        manager: StreamableHTTPSessionManager = server.session_manager
        async with manager.run():
            self._transport = StreamableHTTPASGIApp(manager)
            self._manager = manager
            try:
                yield
            finally:
                self._transport = None
                self._manager = None

    def route(self) -> Route:
        return Route(MCP_PATH, endpoint=self, methods=["GET", "POST", "DELETE"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        owner = self._authenticate(request)  # raises 401, answered by the app's handler
        if self._transport is None:
            raise HTTPException(503, "the MCP endpoint is starting or stopping")
        scope[OWNER_SCOPE_KEY] = owner
        # The transport binds each connection to the principal that opened it: another key's
        # request on it answers 404, exactly like an unknown connection.
        user = _user_of(owner)
        scope["user"] = user
        connection = request.headers.get("mcp-session-id")
        version = request.headers.get("mcp-protocol-version")
        handshake = version is None or version in HANDSHAKE_PROTOCOL_VERSIONS
        if connection and handshake:
            refused = await self._continue(connection, owner, user, version)
            if refused is not None:
                await refused(scope, receive, send)
                return
        opening = connection is None and handshake and request.method == "POST"
        # What the client posts on a connection may answer what another replica asked it.
        answering = (
            bool(connection)
            and handshake
            and request.method == "POST"
            and self._service.mcp_connections.answers_travel
        )
        body: bytearray | None = bytearray() if opening or answering else None
        status = 0

        async def kept(message: Message) -> None:
            nonlocal body
            if message["type"] == "http.request" and body is not None:
                body += message.get("body", b"")
                if len(body) > max(MAX_CLIENT_BYTES, MAX_ANSWER_BYTES):
                    body = None  # an initialize (or answer) this large is not kept elsewhere

        async def read() -> Message:
            message = await receive()
            await kept(message)
            return message

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                opened = _header(message, b"mcp-session-id")
                if opening and opened and 200 <= status < 300:
                    # Known to every replica before the client learns its id (the request
                    # was read whole to answer it).
                    await self._opened(opened, owner, body)
            await send(message)

        await self._transport(scope, read if body is not None else receive, watched)
        if request.method == "DELETE" and connection and 200 <= status < 300:
            await self.connections.end(owner, connection)
        elif connection and handshake:
            if answering and body is not None and status == HTTPStatus.ACCEPTED:
                await self._pass_on(connection, bytes(body))
            await self._request_ended(connection)

    # --- answers the client sends through another replica than the one that asked
    async def _pass_on(self, connection: str, body: bytes) -> None:
        """A client's answer (a JSON-RPC response) accepted here: kept for the replicas that
        wait for one on its connection (this one's transport had it already)."""
        if not _is_answer(body):
            return
        try:
            await self._service.mcp_connections.pass_on(connection, self._replica, body)
        except SessionError as exc:
            log.warning(
                "an answer on MCP connection %s was not passed on: %s", connection[:64], exc
            )

    @asynccontextmanager
    async def answers_elsewhere(self, ctx: Context) -> AsyncIterator[None]:
        """While an approval is asked of the client of the call `ctx` serves: what it answers
        through another replica is handed to this replica's transport too."""
        request = ctx.request_context.request
        connections = self._service.mcp_connections
        connection = request.headers.get("mcp-session-id") if request is not None else None
        owner = request.scope.get(OWNER_SCOPE_KEY) if request is not None else None
        if not connections.answers_travel or not connection or not isinstance(owner, str):
            yield  # one process (every answer comes here), or no connection to answer on
            return
        assert request is not None  # it named a connection
        # The headers the transport checks, as the client sent them on the asking request.
        headers = [(k, v) for k, v in request.headers.raw if k.lower() in _REPLAYED_HEADERS]
        try:
            await connections.awaiting(connection, self._replica, 1)
        except SessionError as exc:  # then only an answer sent here reaches the question
            log.warning("MCP connection %s: answers stay where sent: %s", connection[:64], exc)
            yield
            return
        # Told to stop, never cancelled: the answer it hands over is what ends the wait, while
        # it is still inside the transport's handler (which a cancellation would leave hung).
        done = asyncio.Event()
        relay = asyncio.ensure_future(self._hand_over_passed_on(connection, owner, headers, done))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        try:
            yield
        finally:
            done.set()

    async def _hand_over_passed_on(
        self, connection: str, owner: str, headers: list[tuple[bytes, bytes]], done: asyncio.Event
    ) -> None:
        """Until `done`: each answer another replica kept for this one, to the transport; then
        this replica waits no more."""
        connections = self._service.mcp_connections
        try:
            while not done.is_set():
                try:
                    answers = await connections.passed_on(connection, self._replica)
                except SessionError as exc:
                    log.warning("MCP connection %s: answers not taken: %s", connection[:64], exc)
                    answers = []
                for answer in answers:
                    try:
                        await asyncio.wait_for(
                            self._replay(connection, owner, headers, answer), REPLAY_S
                        )
                    except Exception:  # one answer's trouble is its own: the next ones go on
                        log.exception("MCP connection %s: an answer was lost", connection[:64])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), ANSWER_POLL_S)
        finally:
            with contextlib.suppress(SessionError):
                await connections.awaiting(connection, self._replica, -1)

    async def _replay(
        self, connection: str, owner: str, headers: list[tuple[bytes, bytes]], answer: bytes
    ) -> None:
        """Post `answer` to this replica's own transport, as the connection's owner."""
        transport = self._transport
        if transport is None:
            return
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": MCP_PATH,
            "raw_path": MCP_PATH.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                *headers,
                (b"mcp-session-id", connection.encode()),
                (b"content-type", b"application/json"),
                (b"accept", b"application/json, text/event-stream"),
                (b"content-length", str(len(answer)).encode()),
            ],
            "client": None,
            "server": None,
            "state": {},
            "user": _user_of(owner),
            OWNER_SCOPE_KEY: owner,
        }
        given = False

        async def receive() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": answer, "more_body": False}
            await asyncio.Event().wait()  # the request is whole: no more comes, none leaves
            raise AssertionError("unreachable")

        status = 0

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await transport(scope, receive, send)
        if status != HTTPStatus.ACCEPTED:
            log.warning(
                "MCP connection %s: an answer passed on from another replica was refused here (%d)",
                connection[:64],
                status,
            )

    async def _continue(
        self, connection: str, owner: str, user: AuthenticatedUser, version: str | None
    ) -> ASGIApp | None:
        """A request on a connection: refused if it ended (through any replica) or is another
        key's; continued here if it was opened through another replica. None: go on."""
        manager = self._manager
        assert manager is not None
        requestor = authorization_context(user)
        try:
            found = await self._service.mcp_connections.get(connection)
        except SessionError as exc:  # the shared store failed: what is held here goes on
            if adoption.held_for(manager, connection, requestor):
                return None
            return _refusal(str(exc), exc.status)
        if found == "ended" or (isinstance(found, McpConnection) and found.owner != owner):
            if found == "ended" and adoption.holds(manager, connection):
                await adoption.discard(manager, connection)
            return _refusal("Session not found", 404)
        if found is None:  # unknown to the store: the transport answers (404 unless held)
            if adoption.held_for(manager, connection, requestor):  # it outlived its entry
                await self._opened(connection, owner, None)
            return None
        if adoption.holds(manager, connection) or not adoption.adoptable(manager):
            return None
        if not await adoption.adopt(manager, connection, requestor, found.client, version):
            return _refusal("Too many open sessions", 503)
        return None

    async def _request_ended(self, connection: str) -> None:
        """A request on it ended: its entry is kept from now (a long call never outlives it)."""
        try:
            await self._service.mcp_connections.request_ended(connection)
        except SessionError as exc:
            log.warning("MCP connection %s was not kept alive: %s", connection[:64], exc)

    async def _opened(self, connection: str, owner: str, body: bytearray | None) -> None:
        """A connection was opened here: told to the store with what its client said."""
        client = None
        if body is not None and not nests_deeper_than(bytes(body), _CLIENT_DEPTH):
            try:
                message = json.loads(body)
            except ValueError:
                message = None
            params = message.get("params") if isinstance(message, dict) else None
            client = params if isinstance(params, dict) else None
        try:
            await self._service.mcp_connections.opened(connection, owner, client)
        except SessionError as exc:  # then only this replica continues it
            log.warning("MCP connection %s is not shared: %s", connection[:64], exc)


def _user_of(owner: str) -> AuthenticatedUser:
    """The MCP SDK's user for a key's owner: its transport binds each connection to it."""
    return AuthenticatedUser(AccessToken(token=owner, client_id=owner, scopes=[]))


def _is_answer(body: bytes) -> bool:
    """Whether `body` is a JSON-RPC response (a result or an error for an id)."""
    if nests_deeper_than(body, _CLIENT_DEPTH):
        return False
    try:
        message = json.loads(body)
    except ValueError:
        return False
    return (
        isinstance(message, dict)
        and "method" not in message
        and message.get("id") is not None
        and ("result" in message or "error" in message)
    )


def _header(message: Message, name: bytes) -> str | None:
    for key, value in message.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None
