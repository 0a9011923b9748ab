"""The console as an application of its own, mounted under `/console` by create_app: its pages,
its vendored static files, its security headers, and its errors as pages (not JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.console import approval_pages, audit_pages, login_pages, session_pages
from orchestrator.console.console_auth import BadForm, ConsoleAuth, NotLoggedIn
from orchestrator.console.context import Console, base
from orchestrator.console.headers import ConsoleHeaders
from orchestrator.console.login_pages import logged_out
from orchestrator.console.render import page
from orchestrator.console.shown_outputs import ShownOutputs
from orchestrator.sessions import SessionError

if TYPE_CHECKING:
    from orchestrator.front_config import FrontConfig
    from orchestrator.key_throttle import KeyThrottle
    from orchestrator.service import Service

STATIC = Path(__file__).parent / "static"
PREFIX = "/console"


def _error_page(request: Request, status: int, title: str, message: str) -> Response:
    return page(
        "error.html",
        status,
        title=title,
        section="error",
        base=base(request),
        viewer=None,
        message=message,
    )


def console_app(service: Service, fronts: FrontConfig, throttle: KeyThrottle) -> FastAPI:
    """`throttle`: the service's throttle of wrong keys (its API's: the same budgets)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    auth = ConsoleAuth(service, fronts, throttle)
    app.state.console = Console(service, auth, ShownOutputs(service))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    for module in (login_pages, session_pages, approval_pages, audit_pages):
        app.include_router(module.router)
    app.add_middleware(ConsoleHeaders)

    @app.exception_handler(NotLoggedIn)
    async def not_logged_in(request: Request, exc: NotLoggedIn) -> Response:
        return logged_out(request, exc.why)

    @app.exception_handler(BadForm)
    async def bad_form(request: Request, exc: BadForm) -> Response:
        return _error_page(request, 403, "Refused", f"{exc}: reload the page and try again.")

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError) -> Response:
        return _error_page(request, exc.status, "Not here", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = "No such page." if exc.status_code == 404 else str(exc.detail)
        return _error_page(request, exc.status_code, "Not here", message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_page(request, 400, "Refused", "That request is not one this console makes.")

    # Answered as a page; the error still goes on up, and the server logs it.
    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        return _error_page(
            request, 500, "Failed", "The console failed; the service's log says why."
        )

    return app
