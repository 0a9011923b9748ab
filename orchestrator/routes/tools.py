"""The tools over HTTP: `code_interpreter`, and `run_command` when the operator turned it on;
each one's definition, and invoking it with a model's call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from code_interpreter_wire.rest import ExecutionRecord, InvokeRequest, InvokeResponse
from code_interpreter_wire.tool_arguments import (
    SHELL_TOOL_NAME,
    TOOL_NAME,
    ToolCallError,
    parse_arguments,
    parse_shell_arguments,
)
from code_interpreter_wire.tool_definitions import (
    LIBRARIES,
    ToolFormat,
    definitions,
    shell_definitions,
)
from code_interpreter_wire.tool_output import format_output
from orchestrator.model_tool import ModelTool, ToolOutcome
from orchestrator.routes.deps import OwnerDep, ServiceDep, unless_disconnected

router = APIRouter(prefix="/v1/tools", tags=["tool"])


@router.get(
    f"/{TOOL_NAME}", summary="The tool's definition for OpenAI, Anthropic, MCP and JSON Schema"
)
async def definition(
    service: ServiceDep,
    owner: OwnerDep,
    format: ToolFormat | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    """With `session_id`, the description lists that session's host tools and languages;
    otherwise those of the sessions the tool creates itself (settings:
    host_tools.session_default, and the default backend's languages)."""
    session = None if session_id is None else await service.lifecycle.get(session_id, owner)
    if session is not None:
        names = service.views.session_tools(session)
    else:
        names = service.channels.default_tools()
    defs = definitions(
        timeout_s=service.admission.tool_timeout(),
        libraries=LIBRARIES,
        host_tools=service.channels.summaries(names),
        languages=await service.views.tool_languages(session),
        network=service.views.network_of(session),
    )
    return defs[format] if format is not None else defs


@router.post(
    f"/{TOOL_NAME}/invoke",
    summary="Run a model's tool call; the output comes back in its API's shape",
)
async def invoke(
    body: InvokeRequest, request: Request, service: ServiceDep, owner: OwnerDep
) -> InvokeResponse:
    """Answers 200 for anything the model did wrong (bad JSON, a missing field, an unknown
    session), with a tool output telling it what to fix; only auth and server faults are HTTP
    errors. A caller that disconnects interrupts its code."""
    try:
        args = parse_arguments(body.arguments)
    except ToolCallError as exc:
        outcome = ToolOutcome.refused(str(exc), "invalid_call")
    else:
        base = (service.views.public_url() or str(request.base_url)).rstrip("/")

        def links(session_id: str, record: ExecutionRecord) -> tuple[str, dict[str, str]]:
            prefix = f"{base}/v1/sessions/{session_id}"
            return (
                f"{prefix}/executions/{record.execution_id}",
                {a.id: f"{prefix}/artifacts/{a.id}" for a in record.artifacts},
            )

        outcome = await unless_disconnected(
            request,
            ModelTool(service).invoke(
                owner, args.code, session_id=args.session_id, links=links, language=args.language
            ),
        )
    return _response(body, outcome)


def _response(body: InvokeRequest, outcome: ToolOutcome) -> InvokeResponse:
    out = format_output(
        body.format, outcome.rendered, call_id=body.call_id, inline_images=body.inline_images
    )
    return InvokeResponse(
        session_id=outcome.session_id,
        execution_id=outcome.record.execution_id if outcome.record is not None else None,
        status=outcome.status,
        **out,
    )


@router.get(
    f"/{SHELL_TOOL_NAME}",
    summary="The shell tool's definition, when the operator turned it on (else 404)",
)
async def shell_definition(service: ServiceDep, format: ToolFormat | None = None) -> dict[str, Any]:
    """`run_command`: shell command lines in the same sessions as code_interpreter. Off unless
    the operator sets CODE_INTERPRETER_SHELL_TOOL=true; then 404 says so."""
    ModelTool(service).check_shell()
    defs = shell_definitions(
        timeout_s=service.admission.tool_timeout(),
        libraries=LIBRARIES,
        network=service.views.network_of(None),
    )
    return defs[format] if format is not None else defs


@router.post(
    f"/{SHELL_TOOL_NAME}/invoke",
    summary="Run a model's shell tool call, when the operator turned the tool on (else 404)",
)
async def invoke_shell(
    body: InvokeRequest, request: Request, service: ServiceDep, owner: OwnerDep
) -> InvokeResponse:
    """As code_interpreter's invoke: 200 for anything the model did wrong, with a tool output
    telling it what to fix. Status: ok (exit code 0), error (another exit code), timeout, or
    why the call was refused. A caller that disconnects kills its command."""
    tool = ModelTool(service)
    tool.check_shell()
    try:
        args = parse_shell_arguments(body.arguments)
    except ToolCallError as exc:
        outcome = ToolOutcome.refused(str(exc), "invalid_call")
    else:
        outcome = await unless_disconnected(
            request,
            tool.invoke_shell(
                owner, args.command, session_id=args.session_id, timeout_s=args.timeout_s
            ),
        )
    return _response(body, outcome)
