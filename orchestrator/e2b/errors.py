"""Errors as E2B answers them: `{"code": <status>, "message": ...}`, which is what its SDK parses
(a body without `code` makes the SDK fail on its own error path).

Every E2B route uses `E2BRoute`, so a typed error of ours becomes the E2B status its SDK turns into
the matching exception: 404 NotFound, 401 Authentication, 429 RateLimit, 502 "was not found"
(the sandbox is gone). Errors no retry can fix carry `Should-Retry: false`, so the SDK does not
retry them with back-off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from orchestrator.e2b.sandboxes import SandboxGone
from orchestrator.metrics import METRICS
from orchestrator.routes.deps import ClientGone
from orchestrator.sessions import SessionError, SessionExpired
from sandbox.errors import (
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)

log = logging.getLogger(__name__)

_STATUS: list[tuple[type[Exception], int]] = [
    (InvalidPath, 400),
    (FileMissing, 404),
    (FileAccessError, 400),
    (FileTooLarge, 413),
    (SandboxClosed, 502),
    (BackendRateLimited, 429),
    (BackendTimeout, 504),
    (BackendUnavailable, 503),
    (SandboxStartError, 503),
    (SandboxError, 500),
]


class E2BError(Exception):
    """An answer of the E2B API other than success."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def e2b_error(status: int, message: str, kind: str = "E2BError") -> JSONResponse:
    METRICS.errors.labels(kind).inc()
    headers = {"Should-Retry": "false"} if status in (429, 503) else None
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def error_response(exc: Exception) -> JSONResponse:
    """The E2B-shaped answer for an error raised while serving an E2B route."""
    kind = type(exc).__name__
    if isinstance(exc, E2BError):
        return e2b_error(exc.status, str(exc), kind)
    if isinstance(exc, SandboxGone):
        return e2b_error(502, str(exc), kind)
    if isinstance(exc, SessionExpired):  # E2B has no "expired": a killed sandbox is not found
        return e2b_error(404, str(exc), kind)
    if isinstance(exc, SessionError):
        return e2b_error(exc.status, str(exc), kind)
    if isinstance(exc, HTTPException):
        return e2b_error(exc.status_code, str(exc.detail), kind)
    if isinstance(exc, RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return e2b_error(400, problems, kind)
    if isinstance(exc, ClientGone):
        return e2b_error(499, "the client disconnected; its code was stopped", kind)
    for error_type, status in _STATUS:
        if isinstance(exc, error_type):
            return e2b_error(status, str(exc), kind)
    log.exception("unhandled error on an E2B route", exc_info=exc)
    return e2b_error(500, "the server failed; see its log", "InternalError")


class E2BRoute(APIRoute):
    """A route whose errors come back in E2B's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return route
