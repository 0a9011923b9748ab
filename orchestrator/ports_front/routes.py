"""The routes of sessions' ports: `/v1/sessions/{id}/ports/{port}/{path}`, every HTTP method
and WebSocket. A `<port>-<id>.<domain>` host comes here too, its path unprefixed
(host_form.py). The request gate lets these through unread (request_guard.py): the caller is
settled here, by the service, before anything of the body is read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import httpcore
from fastapi import APIRouter, HTTPException, Request, WebSocket
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, RedirectResponse, Response

from code_interpreter_wire.errors import PortUnreachable, SandboxError
from orchestrator.auth import Authenticator
from orchestrator.caller_mark import caller_proven
from orchestrator.http_errors import status_of
from orchestrator.ports_front.caller import port_caller
from orchestrator.ports_front.http_relay import relay_http
from orchestrator.ports_front.websocket_relay import (
    HandshakeRefused,
    open_upstream,
    relay_messages,
)
from orchestrator.service import Service
from orchestrator.service_parts.ports import PortCaller, PortConnection
from orchestrator.sessions import Session, SessionError

PATH = "/v1/sessions/{session_id}/ports/{port}"
HOST_FORM = "port_host_form"  # scope key set by host_form.py: the path was not prefixed
ORIGINAL_PATH = "port_original_path"  # ... and the raw path the client asked for
_PREFIX_SEGMENTS = 6  # "", "v1", "sessions", its id, "ports", its port
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

router = APIRouter(tags=["ports"])


def _target(scope: Mapping[str, Any]) -> str:
    """The path (as the client spelt it, escapes kept) and query the server is asked for: on
    the path form, what follows `/v1/sessions/{id}/ports/{port}`, by segments."""
    raw = scope.get(ORIGINAL_PATH) or scope.get("raw_path") or str(scope["path"]).encode()
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
    if not scope.get(HOST_FORM):
        path = "/" + "/".join(path.split("/")[_PREFIX_SEGMENTS:])
    query = scope.get("query_string") or b""
    assert isinstance(query, bytes)
    return (path or "/") + ("?" + query.decode("latin-1") if query else "")


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


async def _granted(
    service: Service, authenticate: Authenticator, request: Request | WebSocket, session_id: str
) -> tuple[Session, PortCaller]:
    """The session and caller, once the service has let the caller in (else its refusal)."""
    caller = port_caller(request, authenticate, path_form=not request.scope.get(HOST_FORM))
    session = await service.ports.session_for(session_id, caller)
    service.ports.check(session, caller)
    caller_proven(request.scope)
    return cast("Session", session), caller


async def port_request(request: Request, session_id: str, port: int, path: str = "") -> Response:
    service: Service = request.app.state.service
    authenticate: Authenticator = request.app.state.authenticate
    session, caller = await _granted(service, authenticate, request, session_id)
    prefix = PATH.format(session_id=session_id, port=port)
    host_form = bool(request.scope.get(HOST_FORM))
    if not host_form and request.scope["path"] == prefix:  # relative links need the slash
        query = request.scope.get("query_string", b"").decode("latin-1")
        return RedirectResponse(prefix + "/" + ("?" + query if query else ""), 307)
    target = _target(request.scope)

    async def opener(asked: int) -> PortConnection:
        return await service.ports.connect(session, asked, caller)

    try:
        return await relay_http(
            request,
            opener,
            port=port,
            target=target,
            host=_host_for(session, port, request),
            forwarded_prefix=None if host_form else prefix,
            timeout_s=service.ports.settings.ports_timeout_s,
        )
    except ClientDisconnect:
        return _error(499, "ClientClosedRequest", "the client left before its request was sent")
    except httpcore.TimeoutException as exc:
        return _error(504, "PortTimeout", f"the server on port {port} did not answer: {exc}")
    except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
        return _error(
            502,
            "PortBadAnswer",
            f"the server on port {port} ended the connection without a valid HTTP answer "
            f"({type(exc).__name__}: {exc})",
        )


# One route per method: a route of several methods gives each the same OpenAPI operation id.
for _method in _METHODS:
    router.add_api_route(
        PATH + "/{path:path}",
        port_request,
        methods=[_method],
        summary="A request to a server the session's code started (its inbound ports)",
        operation_id=f"port_request_{_method.lower()}",
    )
    router.add_api_route(PATH, port_request, methods=[_method], include_in_schema=False)


@router.websocket(PATH)
@router.websocket(PATH + "/{path:path}")
async def port_websocket(websocket: WebSocket, session_id: str, port: int, path: str = "") -> None:
    service: Service = websocket.app.state.service
    authenticate: Authenticator = websocket.app.state.authenticate
    try:
        session, caller = await _granted(service, authenticate, websocket, session_id)
        connection = await service.ports.connect(session, port, caller)
    except (SessionError, SandboxError, HTTPException) as exc:
        await _deny(websocket, exc)
        return
    try:
        target = _target(websocket.scope)
        try:
            host = _host_for(session, port, websocket)
            path_form = not websocket.scope.get(HOST_FORM)
            protocol, subprotocol, early = await open_upstream(
                websocket, connection, target, host, path_form=path_form
            )
        except (HandshakeRefused, TimeoutError, ConnectionResetError, SandboxError) as exc:
            await _deny(websocket, PortUnreachable(f"the WebSocket on port {port}: {exc}"))
            return
        except ValueError as exc:  # a Host no WebSocket URI can be made of
            await _deny(websocket, InvalidHost(f"the request's Host does not read: {exc}"))
            return
        await websocket.accept(subprotocol=subprotocol)
        await relay_messages(websocket, protocol, connection, early)
    finally:
        await connection.close()


class InvalidHost(SessionError):
    """A request whose Host header cannot name a server (a WebSocket's URI is made of it)."""

    status = 400


def _host_for(session: Session, port: int, request: Request | WebSocket) -> str:
    asked = request.headers.get("host", f"localhost:{port}")
    return session.ports.host_for(port, asked) if session.ports is not None else asked


async def _deny(websocket: WebSocket, exc: Exception) -> None:
    """Refuse the WebSocket with an HTTP answer saying why, where the server can send one."""
    if isinstance(exc, HTTPException):
        status, kind, message = exc.status_code, "Unauthorized", str(exc.detail)
    elif isinstance(exc, SessionError):
        status, kind, message = exc.status, type(exc).__name__, str(exc)
    else:
        status, kind, message = status_of(exc) or 502, type(exc).__name__, str(exc)
    try:
        await websocket.send_denial_response(_error(status, kind, message))
    except RuntimeError:  # the server has no denial responses: a close with the reason
        await websocket.close(1008, message[:120])
