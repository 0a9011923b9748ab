"""Errors as E2B answers them: `{"code": <status>, "message": ...}`, which is what its SDK parses
(a body without `code` makes the SDK fail on its own error path).

Every E2B route uses `E2BRoute`, so a typed error of ours becomes the E2B status its SDK turns into
the matching exception: 404 NotFound, 401 Authentication, 429 RateLimit, 502 "was not found"
(the sandbox is gone). Only a rate limit carries `Should-Retry: true`; every other error says
false, so the SDK does not wait and retry what waiting cannot fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from code_interpreter_wire.errors import FileAccessError, SandboxClosed, SandboxError
from orchestrator.e2b_compatible.sandboxes import SandboxGone
from orchestrator.http_errors import problems, status_of
from orchestrator.metrics import METRICS
from orchestrator.request_context import ClientGone
from orchestrator.sessions import SessionError, SessionExpired

log = logging.getLogger(__name__)

# Where E2B's SDK expects other statuses than our API gives: a refused path is a bad request,
# and a sandbox that is gone answers 502 "was not found".
_E2B_STATUS: dict[type[Exception], int] = {FileAccessError: 400, SandboxClosed: 502}


class E2BError(Exception):
    """An answer of the E2B API other than success."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# The one error of ours that waiting fixes: the SDK retries it with back-off (its default for 429).
_WORTH_RETRYING = ("BackendRateLimited",)


def e2b_error(status: int, message: str, kind: str = "E2BError") -> JSONResponse:
    """E2B's error body. The SDK retries 429, 502, 503 and 504 unless told otherwise; only a rate
    limit is worth it here (a gone sandbox or a full quota does not come back by waiting)."""
    METRICS.errors.labels(kind).inc()
    headers = {"Should-Retry": "true" if kind in _WORTH_RETRYING else "false"}
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def error_response(exc: Exception, *, named: bool = False) -> JSONResponse:
    """The E2B-shaped answer for an error raised while serving an E2B route; `named`: a typed
    refusal of ours (SessionError, SandboxError) has its type before its message, as E2B's
    body has no field for it (its volume routes, whose SDK callers tell refusals apart so)."""
    kind = type(exc).__name__
    if isinstance(exc, E2BError):
        return e2b_error(exc.status, str(exc), kind)
    if isinstance(exc, SandboxGone):
        return e2b_error(502, str(exc), kind)
    said = f"{kind}: {exc}" if named and isinstance(exc, SessionError | SandboxError) else str(exc)
    if isinstance(exc, SessionExpired):  # E2B has no "expired": a killed sandbox is not found
        return e2b_error(404, said, kind)
    if isinstance(exc, SessionError):
        return e2b_error(exc.status, said, kind)
    if isinstance(exc, HTTPException):
        return e2b_error(exc.status_code, str(exc.detail), kind)
    if isinstance(exc, RequestValidationError):
        return e2b_error(400, problems(exc.errors()), kind)
    if isinstance(exc, ClientGone):
        return e2b_error(499, "the client disconnected; its code was stopped", kind)
    status = status_of(exc, _E2B_STATUS)
    if status is not None:
        return e2b_error(status, said, kind)
    log.exception("unhandled error on an E2B route", exc_info=exc)
    return e2b_error(500, "the server failed; see its log", "InternalError")


class E2BRoute(APIRoute):
    """A route whose errors come back in E2B's shape."""

    named: ClassVar[bool] = False  # our refusals' type named in the message (error_response)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        named = self.named

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc, named=named)

        return route


class E2BNamedRoute(E2BRoute):
    """An E2B route whose refusals name their type in the message (`VolumeInUse: ...`): the
    volume routes'. The others' messages stay as E2B's own (its SDK matches some of them)."""

    named = True
