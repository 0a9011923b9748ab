"""E2B's code-interpreter data plane: `POST /execute` streaming NDJSON, and `/health`.

Code runs in the kernel of its context: the default context of `language` (E2B's names and
aliases; Python if none) in the sandbox's own session, or a context made at /contexts. A
language the sandbox lacks is refused (400) naming the languages it has.

One JSON object per line, as E2B's SDK parses them: `stdout`/`stderr` (with a timestamp in
nanoseconds), `result` (the MIME forms by name, `is_main_result`), `error` (`name`, `value`,
`traceback`), then `number_of_executions` and `end_of_execution`, with a `keepalive` line at least
every 5 s. A client that disconnects (E2B's SDK does so at its `timeout`) interrupts the code, as
the /v1 stream does: the kernel is interrupted, or replaced if it ignores the interrupt.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.languages import canonical_language
from code_interpreter_wire.rest import Env, KernelText
from code_interpreter_wire.results import (
    ErrorEvent,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)
from orchestrator.e2b_compatible.deps import E2BDep, PortReachedDep, Reached, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.sandboxes import REFUSALS, E2BSandboxes
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError
from orchestrator.streaming import Dropped, Finished, Keepalive

log = logging.getLogger(__name__)
router = APIRouter(route_class=E2BRoute, tags=["e2b"])
_TEXT_FORMS = ("text", "html", "markdown", "latex", "png", "jpeg", "svg", "pdf", "javascript")


class ExecuteBody(BaseModel):
    code: KernelText
    context_id: str | None = None
    language: str | None = None
    env_vars: Env | None = None


class SandboxKilled(Exception):
    """The sandbox was killed while code ran in it: the answer is cut off (see `ExecuteStream`)."""


class ExecuteStream(StreamingResponse):
    """The NDJSON answer of /execute, cut off without its last chunk if the sandbox is killed
    under it, as E2B's proxy drops the connection of a sandbox that goes. E2B's SDK reads a
    stream that breaks off as a broken connection, asks /health whether the sandbox still runs
    (502: it does not), and raises "The sandbox was killed while the request was in progress"
    (e2b_code_interpreter: `_handle_connection_error`, `format_sandbox_killed_error`)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except SandboxKilled as killed:  # the server closes the connection, the body unfinished
            log.info("E2B sandbox %s was killed during an execution; answer cut off", killed)


@dataclass(frozen=True)
class Target:
    """Where code of a context runs: a session, a language, a working directory for each call
    (None: the kernel's own, which is E2B's home on this front: its sessions are made with
    `workdir` there)."""

    session: Session
    language: str
    cwd: str | None


async def context_target(
    service: Service, reached: Reached, context_id: str | None, language: str | None = None
) -> Target:
    """The target of a context id (None: the default context of `language`, Python if None)."""
    record, session = reached.record, reached.session
    if context_id is None:
        return Target(session, canonical_language(language), None)
    default = record.default_context_language(context_id, service.views.session_languages(session))
    if default is not None:
        return Target(session, default, None)
    context = record.contexts.get(context_id)
    if context is None:
        raise E2BError(404, f"Context {context_id} not found")  # E2B's words
    try:
        found = await service.lifecycle.get(context.id, record.owner)
    except REFUSALS:
        raise  # paused, and its key may not wake it now: said why
    except SessionError:
        raise E2BError(404, f"Context {context_id} has ended") from None
    return Target(found, context.language, context.cwd)


@router.get("/health", summary="E2B: health (of the sandbox named by E2b-Sandbox-Id, if any)")
async def health(request: Request, sandboxes: E2BDep) -> dict[str, str]:
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if sandbox_id:
        token = request.headers.get("x-access-token") or request.headers.get(
            "e2b-traffic-access-token"
        )
        await sandboxes.reachable(sandbox_id, token, port_traffic=True)
    return {"status": "ok"}


@router.post(
    "/execute",
    summary="E2B: run code, streaming its output as NDJSON",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def execute(
    body: ExecuteBody, reached: PortReachedDep, service: ServiceDep, sandboxes: E2BDep
) -> StreamingResponse:
    if body.context_id and body.language:
        raise E2BError(400, "Only one of context_id or language can be provided")  # E2B's words
    target = await context_target(service, reached, body.context_id, body.language)
    # The client's own deadline governs (it disconnects); ours is the service's ceiling. An
    # unknown or missing language is refused here, before the answer starts.
    stream = service.runs.stream(
        target.session,
        body.code,
        timeout_s=service.admission.execution_ceiling(),
        env=dict(body.env_vars or {}) or None,
        cwd=target.cwd,
        language=target.language,
    )

    async def lines() -> AsyncIterator[bytes]:
        try:
            async with aclosing(stream) as events:  # closed at once if the client leaves
                async for item in events:
                    if isinstance(item, Keepalive):
                        yield _encode({"type": "keepalive"})
                    elif isinstance(item, Dropped):  # E2B's stream has no other way to say it
                        yield _encode(_line(StderrEvent(text=item.message)) or {})
                    elif isinstance(item, Finished):
                        if item.value.notice:  # a resume's: what came back and what did not
                            notice = StderrEvent(text=f"[notice] {item.value.notice}\n")
                            yield _encode(_line(notice) or {})
                        count = item.value.execution_count
                        if count is not None:
                            line = {"type": "number_of_executions", "execution_count": count}
                            yield _encode(line)
                    elif target.language == "java" and isinstance(item, StdoutEvent):
                        for piece in _java_pieces(item.text):
                            line = {"type": "stdout", "text": piece, "timestamp": time.time_ns()}
                            yield _encode(line)
                    elif (event := _line(item)) is not None:
                        yield _encode(event)
        except (SandboxError, SessionError) as exc:  # a session ended under the run
            if await _killed(service, sandboxes, reached):
                raise SandboxKilled(reached.record.sandbox_id) from exc
            error = {"name": type(exc).__name__, "value": str(exc), "traceback": ""}
            yield _encode({"type": "error", **error})
        if await _killed(service, sandboxes, reached):  # its kernel's death was the kill
            raise SandboxKilled(reached.record.sandbox_id)
        yield _encode({"type": "end_of_execution"})

    return ExecuteStream(lines(), media_type="application/x-ndjson")


async def _killed(service: Service, sandboxes: E2BSandboxes, reached: Reached) -> bool:
    """Whether the sandbox (not merely a context of it) has ended: killed, timed out, deleted."""
    if not sandboxes.is_live(reached.record):
        return True
    try:
        await service.lifecycle.get(reached.record.session_id, reached.record.owner)
    except SessionError:
        return True
    return False


def _java_pieces(text: str) -> list[str]:
    """A Java chunk as E2B's Java kernel sends it: `println`'s line and its newline apart
    (E2B's own tests read `logs.stdout[0] == "Hello, World!"`); the text joined is the same."""
    if len(text) > 1 and text.endswith("\n"):
        return [text[:-1], "\n"]
    return [text]


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
    """A result in E2B's shape: each MIME form under its name, the rest in `extra`.

    As E2B's server builds it (template/server/api/models/result.py): a text wholly within one
    kind of quotes loses them (a string value reads `supertest`, not `'supertest'`); `chart`
    and `data` carry the `e2b/chart` and `e2b/data` forms."""
    out: dict[str, Any] = {"is_main_result": result.is_main_result}
    for name in _TEXT_FORMS:
        value = getattr(result, name)
        if value is not None:
            out[name] = value
    text = result.text
    if text and any(text.startswith(q) and text.endswith(q) for q in ("'", '"')):
        out["text"] = text[1:-1]
    for name, form in (("json", result.json_data), ("chart", result.chart), ("data", result.data)):
        if form is not None:
            out[name] = form
    out["extra"] = result.extra  # E2B's server sends the forms left over, `{}` when none
    return out
