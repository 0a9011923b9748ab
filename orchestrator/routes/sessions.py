"""Sessions and executions: create, list, get, delete, execute (whole or streamed), control."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.rest import (
    CreateSessionRequest,
    ExecuteRequest,
    ExecutionRecord,
    NetworkReport,
    RestartRequest,
    ResumeInfo,
    SessionInfo,
    SnapshotInfo,
    SnapshotRequest,
)
from code_interpreter_wire.results import Execution, OutputEvent
from orchestrator.json_responses import json_response
from orchestrator.outputs import KeptImage, OutputNotFound
from orchestrator.routes.deps import OwnerDep, ServiceDep, SessionDep, unless_disconnected
from orchestrator.sessions import SessionError
from orchestrator.streaming import Dropped, Finished, Keepalive

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
# An artifact a sandbox made (an SVG can hold script) is shown, never run: no script, no
# requests, a unique origin; `nosniff` on every response keeps its declared type.
ARTIFACT_HEADERS = {
    "Cache-Control": "private, max-age=86400",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; sandbox",
}
STREAMS = ("stdout", "stderr")  # an execution's kept text streams, each readable alone


@router.post("", status_code=201, summary="Create a session")
async def create_session(
    body: CreateSessionRequest, service: ServiceDep, owner: OwnerDep
) -> SessionInfo:
    session = await service.lifecycle.create(owner, body)
    return service.views.info(session)


@router.get("", summary="List the caller's sessions, running and paused")
async def list_sessions(
    service: ServiceDep,
    owner: OwnerDep,
    state: Annotated[
        Literal["running", "paused"] | None, Query(description="Only those in this state.")
    ] = None,
) -> list[SessionInfo]:
    return [i for i in await service.lifecycle.infos(owner) if state is None or i.state == state]


@router.get("/{session_id}", summary="Get a session (a paused one stays paused)")
async def get_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> SessionInfo:
    return await service.lifecycle.describe(session_id, owner)


@router.post(
    "/{session_id}/pause",
    summary="Pause a session: save its variables and files, stop its sandbox",
)
async def pause(session_id: str, service: ServiceDep, owner: OwnerDep) -> SessionInfo:
    """A paused session holds no process. The next call on it (or POST .../resume) resumes it;
    its variables, imports, definitions and files come back. What could not be saved (an open
    socket, a generator) is named in the notice of its first execution after. 409 while it
    runs code."""
    return await service.lifecycle.pause(session_id, owner)


@router.post("/{session_id}/resume", summary="Resume a paused session now")
async def resume(session_id: str, service: ServiceDep, owner: OwnerDep) -> ResumeInfo:
    return await service.lifecycle.resume(session_id, owner)


@router.post(
    "/{session_id}/snapshots",
    status_code=201,
    summary="Save the session's variables and files as a snapshot to start sessions from",
)
async def snapshot(
    session: SessionDep, service: ServiceDep, body: SnapshotRequest | None = None
) -> SnapshotInfo:
    return await service.persistence.snapshot(session, body.name if body is not None else None)


@router.delete("/{session_id}", status_code=204, summary="Delete a session and its sandbox")
async def delete_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> Response:
    await service.lifecycle.end(session_id, owner)
    return Response(status_code=204)


@router.post("/{session_id}/keepalive", summary="Mark the session active (resets idle expiry)")
async def keepalive(session: SessionDep, service: ServiceDep) -> SessionInfo:
    return await service.lifecycle.keepalive(session)


@router.get(
    "/{session_id}/network",
    summary="The session's network policy and the latest connections through its proxy",
)
async def network(
    session: SessionDep,
    service: ServiceDep,
    limit: Annotated[int, Query(ge=0, le=1000, description="Most connections listed.")] = 100,
) -> NetworkReport:
    return await service.views.network_report(session, limit)


@router.post("/{session_id}/interrupt", summary="Stop the running execution")
async def interrupt(session: SessionDep, service: ServiceDep) -> dict[str, bool]:
    return {"interrupted": await service.runs.interrupt(session)}


@router.post("/{session_id}/restart", summary="Restart a kernel, or all (files are kept)")
async def restart(
    session: SessionDep, service: ServiceDep, body: RestartRequest | None = None
) -> SessionInfo:
    """Without a body (or `language`), every kernel the session started is replaced."""
    return await service.runs.restart(session, body.language if body is not None else None)


@router.post(
    "/{session_id}/execute",
    summary="Run code and return the whole Execution",
    response_model=ExecutionRecord,
)
async def execute(
    body: ExecuteRequest, request: Request, session: SessionDep, service: ServiceDep
) -> Response:
    """Concurrent calls on one session run one after another, in order. A caller that
    disconnects interrupts its code."""
    record = await unless_disconnected(
        request,
        service.runs.execute(
            session,
            body.code,
            timeout_s=body.timeout_s,
            env=body.env,
            cwd=body.cwd,
            language=body.language,
        ),
    )
    return await json_response(record)  # a large one is serialised off the event loop


def ndjson_line(item: OutputEvent | Dropped | Keepalive | Finished[ExecutionRecord]) -> bytes:
    """How one thing a streamed run yields reads on the wire: one JSON object and a newline."""
    if isinstance(item, Keepalive):
        return b'{"type":"keepalive"}\n'
    if isinstance(item, Dropped):
        dropped = {
            "type": "dropped",
            "events": item.events,
            "characters": item.characters,
            "message": item.message.strip(),
        }
        return json.dumps(dropped).encode() + b"\n"
    if isinstance(item, Finished):
        done = {"type": "done", "execution": item.value.model_dump(mode="json")}
        return json.dumps(done).encode() + b"\n"
    return item.model_dump_json().encode() + b"\n"


@router.post(
    "/{session_id}/execute/stream",
    summary="Run code, streaming its output as NDJSON",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def execute_stream(
    body: ExecuteRequest, session: SessionDep, service: ServiceDep
) -> StreamingResponse:
    """One JSON object per line: `stdout`, `stderr`, `result`, `error` events as they happen,
    `keepalive` at least every 5 s, and last `done` with the whole Execution and its ids (or
    `failure`, if the session itself ended during the run). Closing the connection interrupts
    the code."""

    # Called here, not in `lines`: a language there is not is refused (400) before the stream
    # starts, not as a broken stream.
    run = service.runs.stream(
        session,
        body.code,
        timeout_s=body.timeout_s,
        env=body.env,
        cwd=body.cwd,
        language=body.language,
    )

    async def lines() -> AsyncIterator[bytes]:
        try:
            async with aclosing(run) as events:  # closed at once if the client leaves
                async for item in events:
                    yield ndjson_line(item)
        except (SandboxError, SessionError) as exc:  # the session ended under the run
            error = {"type": type(exc).__name__, "message": str(exc)}
            yield json.dumps({"type": "failure", "error": error}).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get(
    "/{session_id}/executions/{execution_id}",
    summary="A kept Execution, in full",
    response_model=Execution,
    responses={410: {"description": "Evicted to respect the quota on kept outputs."}},
)
async def get_execution(execution_id: str, session: SessionDep, service: ServiceDep) -> Response:
    """Sent as it was stored (already a serialised Execution): never parsed again here."""
    kept = await service.files.open_kept_execution(session, execution_id)
    return StreamingResponse(
        kept.chunks(),
        media_type="application/json",
        headers={"Content-Length": str(kept.size)},
    )


@router.get(
    "/{session_id}/executions/{execution_id}/{stream}",
    summary="The full stdout or stderr of a kept execution",
    response_class=PlainTextResponse,
)
async def get_execution_stream(
    execution_id: str, stream: str, session: SessionDep, service: ServiceDep
) -> PlainTextResponse:
    if stream not in STREAMS:
        raise OutputNotFound(
            f"no output {stream!r} of execution {execution_id}; there are {' and '.join(STREAMS)}"
        )
    execution = await service.files.kept_execution(session, execution_id)
    return PlainTextResponse(getattr(execution, stream))


@router.get(
    "/{session_id}/artifacts/{artifact_id}",
    summary="An image an execution produced",
    response_class=FileResponse,
)
async def get_artifact(artifact_id: str, session: SessionDep, service: ServiceDep) -> Response:
    return image_response(await service.files.artifact(session, artifact_id))


def image_response(kept: KeptImage) -> Response:
    """A kept image, shown and never run (`ARTIFACT_HEADERS`): its file, or its bytes."""
    if kept.path is not None:
        return FileResponse(kept.path, media_type=kept.media_type, headers=ARTIFACT_HEADERS)
    return Response(kept.data or b"", media_type=kept.media_type, headers=ARTIFACT_HEADERS)
