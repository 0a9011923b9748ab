"""The MCP server over streamable HTTP at /mcp, inside the service's own app.

The same bearer keys as the REST API guard it, and the caller's owner travels in the request's
scope to the tools, so one key never reaches another key's sessions. When a client ends its MCP
session (DELETE with its Mcp-Session-Id), the sandbox session behind it ends too. Each connection
belongs to the key that opened it. Connections, and the sessions MCP makes, that are never ended
expire after `mcp_idle_timeout_s` idle: one-shot clients seldom say goodbye.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import HTTPException, Request
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from orchestrator.auth import Authenticator
from orchestrator.front_config import FrontConfig
from orchestrator.mcp_front.server import (
    OWNER_SCOPE_KEY,
    ConnectionSessions,
    build_mcp_server,
)
from orchestrator.service import Service

MCP_PATH = "/mcp"


class McpHttpFront:
    """An ASGI endpoint: authenticate, hand over to the MCP transport, end what the client ends."""

    def __init__(self, service: Service, authenticate: Authenticator, fronts: FrontConfig) -> None:
        self._service = service
        self._fronts = fronts
        self._authenticate = authenticate
        self.connections = ConnectionSessions(service)
        self._transport: StreamableHTTPASGIApp | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve while the service runs; the server is made once the service has started, so
        the tool's description can list the host tools (an MCP server's among them)."""
        fronts = self._fronts
        server, _ = await build_mcp_server(self._service, connections=self.connections)
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
            try:
                yield
            finally:
                self._transport = None

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
        scope["user"] = AuthenticatedUser(AccessToken(token=owner, client_id=owner, scopes=[]))
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self._transport(scope, receive, watched)
        connection = request.headers.get("mcp-session-id")
        if request.method == "DELETE" and connection and 200 <= status < 300:
            await self.connections.end(owner, connection)
