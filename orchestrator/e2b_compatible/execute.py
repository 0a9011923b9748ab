"""E2B's code-interpreter data plane: `POST /execute` streaming NDJSON, and `/health`.

One JSON object per line, as E2B's SDK parses them: `stdout`/`stderr` (with a timestamp in
nanoseconds), `result` (the MIME forms by name, `is_main_result`), `error` (`name`, `value`,
`traceback`), then `number_of_executions` and `end_of_execution`, with a `keepalive` line at least
every 5 s. A client that disconnects (E2B's SDK does so at its `timeout`) interrupts the code, as
the /v1 stream does: the kernel is interrupted, or replaced if it ignores the interrupt.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from orchestrator.e2b_compatible.deps import E2BDep, ReachedDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.sandboxes import E2BRecord
from orchestrator.schemas import Env, KernelText
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError
from orchestrator.streaming import Dropped, Finished, Keepalive
from sandbox.errors import SandboxError
from sandbox.models import (
    ErrorEvent,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)

router = APIRouter(route_class=E2BRoute, tags=["e2b"])
DEFAULT_CONTEXT = "default"
_TEXT_FORMS = ("text", "html", "markdown", "latex", "png", "jpeg", "svg", "pdf", "javascript")


class ExecuteBody(BaseModel):
    code: KernelText
    context_id: str | None = None
    language: str | None = None
    env_vars: Env | None = None


def check_language(language: str | None) -> None:
    if language not in (None, "python", "py", "python3"):
        raise E2BError(400, f"language {language!r} is not supported here: only python is")


async def context_session(
    service: Service, record: E2BRecord, session: Session, context_id: str | None
) -> tuple[Session, str | None]:
    """The session a context runs in, and its working directory (None: the kernel's own)."""
    if context_id in (None, DEFAULT_CONTEXT, record.sandbox_id):
        return session, None
    context = record.contexts.get(context_id or "")
    if context is None:
        raise E2BError(404, f"context {context_id} not found")
    try:
        return await service.get_session(context.id, record.owner), context.cwd
    except SessionError:
        raise E2BError(404, f"context {context_id} has ended") from None


@router.get("/health", summary="E2B: health (of the sandbox named by E2b-Sandbox-Id, if any)")
async def health(request: Request, sandboxes: E2BDep) -> dict[str, str]:
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if sandbox_id:
        token = request.headers.get("x-access-token") or request.headers.get(
            "e2b-traffic-access-token"
        )
        await sandboxes.reachable(sandbox_id, token)
    return {"status": "ok"}


@router.post(
    "/execute",
    summary="E2B: run code, streaming its output as NDJSON",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def execute(body: ExecuteBody, reached: ReachedDep, service: ServiceDep) -> StreamingResponse:
    if body.context_id is None:
        check_language(body.language)
    session, cwd = await context_session(service, reached.record, reached.session, body.context_id)

    async def lines() -> AsyncIterator[bytes]:
        # The client's own deadline governs (it disconnects); ours is the service's ceiling.
        stream = service.stream(
            session,
            body.code,
            timeout_s=service.settings.max_execution_timeout_s,
            env=dict(body.env_vars or {}) or None,
            cwd=cwd,
        )
        try:
            async with aclosing(stream) as events:  # closed at once if the client leaves
                async for item in events:
                    if isinstance(item, Keepalive):
                        yield _encode({"type": "keepalive"})
                    elif isinstance(item, Dropped):  # E2B's stream has no other way to say it
                        yield _encode(_line(StderrEvent(text=item.message)) or {})
                    elif isinstance(item, Finished):
                        count = item.value.execution_count
                        if count is not None:
                            line = {"type": "number_of_executions", "execution_count": count}
                            yield _encode(line)
                    elif (event := _line(item)) is not None:
                        yield _encode(event)
        except (SandboxError, SessionError) as exc:  # the session ended under the run
            error = {"name": type(exc).__name__, "value": str(exc), "traceback": ""}
            yield _encode({"type": "error", **error})
        yield _encode({"type": "end_of_execution"})

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line).encode() + b"\n"


def _line(event: OutputEvent) -> dict[str, Any] | None:
    """An output event as the E2B line its SDK reads."""
    if isinstance(event, StdoutEvent | StderrEvent):
        return {"type": event.type, "text": event.text, "timestamp": time.time_ns()}
    if isinstance(event, ResultEvent):
        return {"type": "result", **result_fields(event.result)}
    if isinstance(event, ErrorEvent):
        error = event.error
        return {
            "type": "error",
            "name": error.name,
            "value": error.value,
            "traceback": error.traceback,
        }
    return None


def result_fields(result: Result) -> dict[str, Any]:
    """A result in E2B's shape: each MIME form under its name, the rest in `extra`."""
    out: dict[str, Any] = {"is_main_result": result.is_main_result}
    for name in _TEXT_FORMS:
        value = getattr(result, name)
        if value is not None:
            out[name] = value
    if result.json_data is not None:
        out["json"] = result.json_data
    if result.extra:
        out["extra"] = result.extra
    return out
