"""The `code_interpreter` tool over HTTP: its definition, and invoking it with a model's call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from orchestrator.host_tools.describe import summaries
from orchestrator.routes.deps import OwnerDep, ServiceDep, unless_disconnected
from orchestrator.schemas import CreateSessionRequest, InvokeRequest, InvokeResponse
from orchestrator.sessions import SessionError
from orchestrator.tool import (
    LIBRARIES,
    TOOL_NAME,
    RenderedOutput,
    ToolCallError,
    ToolFormat,
    definitions,
    format_output,
    parse_arguments,
    render,
)
from sandbox.errors import SandboxError

router = APIRouter(prefix=f"/v1/tools/{TOOL_NAME}", tags=["tool"])


@router.get("", summary="The tool's definition for OpenAI, Anthropic, MCP and JSON Schema")
async def definition(
    service: ServiceDep,
    owner: OwnerDep,
    format: ToolFormat | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    """With `session_id`, the description lists that session's host tools; otherwise those of
    the sessions the tool creates itself (settings: host_tools.session_default)."""
    if session_id is not None:
        names = service.session_tools(await service.sessions.get(session_id, owner))
    else:
        names = service.settings.host_tools.session_default
    defs = definitions(
        timeout_s=service.settings.execution_timeout_s,
        libraries=LIBRARIES,
        host_tools=summaries(service.tools.select(names).values()),
    )
    return defs[format] if format is not None else defs


@router.post("/invoke", summary="Run a model's tool call; the output comes back in its API's shape")
async def invoke(
    body: InvokeRequest, request: Request, service: ServiceDep, owner: OwnerDep
) -> InvokeResponse:
    """Answers 200 for anything the model did wrong (bad JSON, a missing field, an unknown
    session), with a tool output telling it what to fix; only auth and server faults are HTTP
    errors."""
    session_id: str | None = None

    def refuse(message: str, status: str = "invalid_call") -> InvokeResponse:
        rendered = RenderedOutput(f"[error] {message}", [], is_error=True)
        out = format_output(body.format, rendered, call_id=body.call_id, inline_images=True)
        return InvokeResponse(session_id=session_id, execution_id=None, status=status, **out)

    try:
        args = parse_arguments(body.arguments)
    except ToolCallError as exc:
        return refuse(str(exc))
    try:
        if args.session_id is not None:
            session = await service.sessions.get(args.session_id, owner)
        else:
            default_tools = service.settings.host_tools.session_default
            session = await service.create_session(owner, CreateSessionRequest(tools=default_tools))
    except SessionError as exc:
        hint = " Omit session_id to start a new session (earlier variables will be gone)."
        return refuse(f"{exc}.{hint if args.session_id else ''}", "session_error")
    except SandboxError as exc:
        return refuse(f"could not start a sandbox: {exc}", "session_error")
    session_id = session.id
    try:
        record = await unless_disconnected(request, service.run(session, args.code))
    except (SessionError, SandboxError) as exc:  # the session ended or broke during the run
        return refuse(f"the session could not run the code: {exc}", "session_error")
    base = (service.settings.public_url or str(request.base_url)).rstrip("/")
    prefix = f"{base}/v1/sessions/{session.id}"
    rendered = render(
        record,
        session_id=session.id,
        max_chars=service.settings.tool_output_max_chars,
        full_output_url=f"{prefix}/executions/{record.execution_id}",
        artifact_urls={a.id: f"{prefix}/artifacts/{a.id}" for a in record.artifacts},
    )
    out = format_output(
        body.format, rendered, call_id=body.call_id, inline_images=body.inline_images
    )
    return InvokeResponse(
        session_id=session.id, execution_id=record.execution_id, status=record.status, **out
    )
