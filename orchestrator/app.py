"""The FastAPI application: routers, start-up and shutdown, and one JSON shape for errors."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from code_interpreter_wire.errors import SandboxError
from orchestrator import release
from orchestrator.auth import Authenticator
from orchestrator.body_limit import BodySizeLimit
from orchestrator.config import Settings
from orchestrator.console import PREFIX as CONSOLE_PREFIX
from orchestrator.console import console_app
from orchestrator.e2b_compatible import mount as mount_e2b
from orchestrator.e2b_compatible import running as e2b_front_running
from orchestrator.front_config import FrontConfig
from orchestrator.host_tools import ToolRegistry
from orchestrator.http_errors import problems, status_of
from orchestrator.mcp_front.http import McpHttpFront
from orchestrator.metrics import METRICS
from orchestrator.ports_front.host_form import PortHosts
from orchestrator.ports_front.routes import router as port_routes
from orchestrator.request_context import ClientGone
from orchestrator.request_guard import RequestGuard
from orchestrator.routes import approvals as approval_routes
from orchestrator.routes import audit as audit_log
from orchestrator.routes import (
    files,
    languages,
    ops,
    processes,
    sessions,
    snapshots,
    tools,
    volumes,
)
from orchestrator.routes import principal as whoami
from orchestrator.routes import secrets as secret_routes
from orchestrator.security_headers import NoSniff
from orchestrator.service import Service
from orchestrator.sessions import SessionError

log = logging.getLogger(__name__)


def _error(status: int, kind: str, message: str) -> JSONResponse:
    METRICS.errors.labels(kind).inc()
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


def create_app(settings: Settings | None = None, host_tools: ToolRegistry | None = None) -> FastAPI:
    """The app; `host_tools` registers tools for sandboxed code in code (settings can add)."""
    settings = settings or Settings()
    service = Service(settings, host_tools)
    authenticate = Authenticator(settings, lambda: service.admission.principals)
    fronts = FrontConfig.of(settings)  # what the front doors are built with
    mcp = McpHttpFront(service, authenticate, fronts)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            async with mcp.running(), e2b_running():
                yield
        finally:
            await service.close()

    app = FastAPI(
        title="code-interpreter-runtime",
        version=release.version(),
        summary="Sandboxed, stateful Python sessions and the code_interpreter tool for agents.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.authenticate = authenticate
    app.state.fronts = fronts
    routers = (
        sessions, snapshots, files, volumes, processes, tools, languages, ops, whoami, audit_log
    )  # fmt: skip
    app.include_router(approval_routes.router)
    app.include_router(port_routes)  # docs/ports.md: servers in sessions, by path or by host
    app.include_router(secret_routes.router)  # docs/secrets.md: the credential vault
    for router in (module.router for module in routers):
        app.include_router(router)
    app.router.routes.append(mcp.route())
    # The console (docs/governance.md): pages for people, behind its own login cookie.
    app.mount(CONSOLE_PREFIX, console_app(service, fronts, authenticate.throttle))
    # E2B's API (docs/e2b.md): its sweeper runs E2B's sandbox timeouts.
    sandboxes = mount_e2b(app, service) if settings.e2b_compat else None
    e2b_running = (
        functools.partial(e2b_front_running, sandboxes)
        if sandboxes is not None
        else contextlib.nullcontext
    )
    # Outermost last: headers on every answer; sizes, then callers and nesting, before the app.
    app.add_middleware(
        RequestGuard,
        authenticate=authenticate,
        sandboxes=sandboxes,
        max_json_depth=settings.max_json_depth,
        metrics_public=settings.metrics_public,
    )
    app.add_middleware(
        BodySizeLimit, limit=settings.max_request_bytes, upload_limit=settings.max_upload_bytes
    )
    app.add_middleware(NoSniff)
    # Outermost of all: a `<port>-<id>.<domain>` host is the path form to everything after it.
    app.add_middleware(PortHosts, domain=settings.ports_domain)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError) -> JSONResponse:
        return _error(exc.status, type(exc).__name__, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = getattr(exc, "kind", None) or {  # WrongKeysThrottled names its own
            401: "Unauthorized",
            404: "NotFound",
            413: "TooLarge",
        }.get(exc.status_code, "HTTPError")
        response = _error(exc.status_code, kind, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "InvalidRequest", problems(exc.errors()))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        return _error(499, "ClientClosedRequest", "the client disconnected; its code was stopped")

    async def typed_error(request: Request, exc: Exception) -> JSONResponse:
        status = status_of(exc)
        if status is None:
            raise exc
        return _error(status, type(exc).__name__, str(exc))

    # Handled here (not by the catch-all below), so the server does not re-raise them. Every
    # intended "not found" is typed (SessionNotFound, OutputNotFound, FileMissing): anything
    # else, a KeyError included, is a bug, answered 500 and logged.
    app.add_exception_handler(SandboxError, typed_error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "InternalError", "the server failed; see its log")

    return app
