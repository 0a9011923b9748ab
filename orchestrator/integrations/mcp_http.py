"""The MCP server over streamable HTTP at /mcp, inside the service's own app.

The same bearer keys as the REST API guard it, and the caller's owner travels in the request's
scope to the tools, so one key never reaches another key's sessions. When a client ends its MCP
session (DELETE with its Mcp-Session-Id), the sandbox session behind it ends too; an MCP session
that is never ended expires with the service's idle timeout, like any session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from orchestrator.auth import Authenticator
from orchestrator.integrations.mcp_server import OWNER_SCOPE_KEY, build_mcp_server
from orchestrator.service import Service

MCP_PATH = "/mcp"


class McpHttpFront:
    """An ASGI endpoint: authenticate, hand over to the MCP transport, end what the client ends."""

    def __init__(self, service: Service, authenticate: Authenticator) -> None:
        settings = service.settings
        server, self.connections = build_mcp_server(service)
        # Builds the session manager (with DNS-rebinding protection on a loopback host); the
        # Starlette app it returns is not used: the endpoint below is mounted in ours instead.
        server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            host=settings.host,
            session_idle_timeout=settings.idle_timeout_s,
            max_request_body_size=settings.max_request_bytes,
        )
        self.manager: StreamableHTTPSessionManager = server.session_manager
        self._transport = StreamableHTTPASGIApp(self.manager)
        self._authenticate = authenticate

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    def route(self) -> Route:
        return Route(MCP_PATH, endpoint=self, methods=["GET", "POST", "DELETE"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        owner = self._authenticate(request)  # raises 401, answered by the app's handler
        scope[OWNER_SCOPE_KEY] = owner
        await self._transport(scope, receive, send)
        connection = request.headers.get("mcp-session-id")
        if request.method == "DELETE" and connection:
            await self.connections.end(owner, connection)
