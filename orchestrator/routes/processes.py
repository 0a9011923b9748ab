"""Processes beside the kernel over the sessions API: commands (whole or streamed as NDJSON),
background processes, and a terminal over a WebSocket. Each route parses, calls `Service`, and
formats; the process core (sandbox/processes/) does the rest."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from signal import Signals
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect, WebSocketState

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessInfo,
    ProcessOutput,
    ProcessRequest,
    TerminalSize,
)
from orchestrator.auth import Authenticator, client_address
from orchestrator.caller_mark import caller_proven
from orchestrator.front_config import FrontConfig
from orchestrator.http_errors import status_of
from orchestrator.json_responses import json_response
from orchestrator.routes.deps import ServiceDep, SessionDep, unless_disconnected
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError
from orchestrator.streaming import KEEPALIVE_S
from sandbox.processes.managed import Dropped, ProcessEvent

router = APIRouter(prefix="/v1/sessions/{session_id}", tags=["processes"])

NDJSON: dict[int | str, dict[str, Any]] = {200: {"content": {"application/x-ndjson": {}}}}
# The signals a caller may send: those that stop, interrupt, hang up, pause or notify a process.
ALLOWED_SIGNALS = {
    s.name: s
    for s in (
        Signals.SIGTERM,
        Signals.SIGKILL,
        Signals.SIGINT,
        Signals.SIGHUP,
        Signals.SIGUSR1,
        Signals.SIGUSR2,
        Signals.SIGSTOP,
        Signals.SIGCONT,
    )
}
TERMINAL_SHELL = ["/bin/bash", "-i", "-l"]
TERMINAL_ENV = {"TERM": "xterm-256color"}
CLOSE_REASON_BYTES = 120  # a WebSocket close reason holds at most 123 bytes


class SignalNotAllowed(SessionError):
    status = 400


class SignalRequest(BaseModel):
    signal: str | int = Field(
        description="A name (SIGTERM, SIGKILL, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGSTOP, "
        "SIGCONT; the SIG prefix may be left out) or that signal's number."
    )


def signal_number(given: str | int) -> int:
    """The number of an allowed signal, or SignalNotAllowed saying which are."""
    if isinstance(given, int):
        found = next((s for s in ALLOWED_SIGNALS.values() if s.value == given), None)
    else:
        name = given.strip().upper()
        found = ALLOWED_SIGNALS.get(name) or ALLOWED_SIGNALS.get("SIG" + name)
    if found is None:
        raise SignalNotAllowed(
            f"signal {given!r} cannot be sent here; send one of {', '.join(ALLOWED_SIGNALS)} "
            "(by name or number)"
        )
    return int(found)


# --- NDJSON lines of a process's events
class _Lines:
    """Turns a process's events into NDJSON lines: output decoded as UTF-8 per stream, a
    character split across chunks kept whole, undecodable bytes replaced."""

    def __init__(self) -> None:
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}

    def event(self, event: ProcessOutput | Dropped) -> bytes:
        if isinstance(event, Dropped):
            return _line(
                {
                    "type": "dropped",
                    "chunks": event.chunks,
                    "bytes": event.bytes,
                    "message": f"[{event.chunks} chunks ({event.bytes} bytes) of output were not "
                    "streamed: the client read more slowly than the process wrote; the result "
                    "keeps everything the output limits allow]",
                }
            )
        decoder = self._decoders.get(event.stream)
        if decoder is None:
            decoder = self._decoders[event.stream] = codecs.getincrementaldecoder("utf-8")(
                "replace"
            )
        text = decoder.decode(event.data)
        return _line({"type": event.stream, "text": text}) if text else b""

    def flush(self) -> bytes:
        """What each stream's decoder still holds (an incomplete character, replaced)."""
        lines = []
        for stream, decoder in self._decoders.items():
            if text := decoder.decode(b"", final=True):
                lines.append(_line({"type": stream, "text": text}))
        return b"".join(lines)


def _line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, ensure_ascii=False).encode() + b"\n"


KEEPALIVE_LINE = b'{"type":"keepalive"}\n'


async def _with_keepalives(
    events: AsyncIterator[ProcessEvent], every_s: float = KEEPALIVE_S
) -> AsyncIterator[ProcessEvent | None]:
    """`events`, with None whenever nothing came for `every_s`. The pending read survives a
    quiet spell (cancelling it would end the process's event stream); `events` is closed at
    the end, so its listener goes with it."""
    pending: asyncio.Future[ProcessEvent] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        if isinstance(events, AsyncGenerator):
            await events.aclose()


async def _ndjson(
    service: Service, session: Session, pid: int, *, replay: bool, start: bool
) -> AsyncIterator[bytes]:
    """A process's output as NDJSON (after `start`, if asked), keepalives, then `end` with its
    result. Waiting for the result all along keeps the session in use while someone follows."""
    if start:
        yield _line({"type": "start", "pid": pid})
    result = asyncio.ensure_future(service.runs.wait_process(session, pid))
    lines = _Lines()
    try:
        events = await service.runs.process_events(session, pid, replay=replay)
        async for event in _with_keepalives(events):
            if event is None:
                yield KEEPALIVE_LINE
            elif isinstance(event, ProcessEnd):
                break
            elif line := lines.event(event):
                yield line
        if tail := lines.flush():
            yield tail
        done: CommandResult = await result
        yield _line({"type": "end", "result": done.model_dump(mode="json")})
    except (SandboxError, SessionError) as exc:  # the session ended under the stream
        error = {"type": type(exc).__name__, "message": str(exc)}
        yield _line({"type": "failure", "error": error})
    finally:
        if not result.done():
            result.cancel()
        with contextlib.suppress(asyncio.CancelledError, SandboxError, SessionError):
            await result


class _StreamThenCleanUp(StreamingResponse):
    """A stream whose clean-up runs however the response ends: finished, the client gone
    mid-stream, or before the first byte (when the body's own `finally` never runs)."""

    def __init__(
        self, content: AsyncIterator[bytes], clean_up: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="application/x-ndjson")
        self._clean_up = clean_up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._clean_up()


async def _kill(service: Service, session: Session, pid: int) -> None:
    """SIGKILL to a process and everything it started, if it still runs."""
    with contextlib.suppress(SandboxError, SessionError, OSError):
        if (await service.runs.process_info(session, pid)).running:
            await service.runs.signal_process(session, pid, Signals.SIGKILL)


# --- commands
@router.post(
    "/commands",
    summary="Run a command and return its whole result",
    response_model=CommandResult,
)
async def run_command(
    body: ProcessRequest, request: Request, session: SessionDep, service: ServiceDep
) -> Response:
    """`argv` as it is, or `command` through `bash -l -c`, in the session's sandbox beside the
    kernel. Its output is capped like an execution's. A caller that disconnects kills it."""
    result = await unless_disconnected(request, service.runs.run_command(session, body))
    return await json_response(result)


@router.post(
    "/commands/stream",
    summary="Run a command, streaming its output as NDJSON",
    response_class=StreamingResponse,
    responses=NDJSON,
)
async def run_command_stream(
    body: ProcessRequest, request: Request, session: SessionDep, service: ServiceDep
) -> StreamingResponse:
    """One JSON object per line: `start` with its pid, then `stdout`, `stderr` (or `pty`, in a
    terminal) with `text` as it comes, `keepalive` at least every 5 s, `dropped` if the client
    fell behind, and last `end` with the whole CommandResult (or `failure`, if the session
    ended). Closing the connection kills the command (before it starts, e.g. while it waits
    for a human's approval: it never starts)."""
    info = await unless_disconnected(request, service.runs.start_process(session, body))
    lines = _ndjson(service, session, info.pid, replay=True, start=True)
    return _StreamThenCleanUp(lines, lambda: _kill(service, session, info.pid))


# --- background processes
@router.post(
    "/processes",
    status_code=201,
    summary="Start a process in the background",
)
async def start_process(
    body: ProcessRequest, request: Request, session: SessionDep, service: ServiceDep
) -> ProcessInfo:
    """It runs until it ends, is signalled, its time limit passes, or the session ends. Its
    output is always read (it never blocks on a full pipe) and the most recent is kept. A
    caller that disconnects before it starts (e.g. while it waits for a human's approval)
    leaves nothing started."""
    return await unless_disconnected(request, service.runs.start_process(session, body))


@router.get("/processes", summary="List the session's processes")
async def list_processes(
    session: SessionDep,
    service: ServiceDep,
    include_ended: Annotated[
        bool, Query(description="Also those that ended (the most recent are remembered).")
    ] = False,
) -> list[ProcessInfo]:
    return await service.runs.list_processes(session, include_ended=include_ended)


@router.get("/processes/{pid}", summary="Get a process")
async def get_process(pid: int, session: SessionDep, service: ServiceDep) -> ProcessInfo:
    return await service.runs.process_info(session, pid)


@router.get(
    "/processes/{pid}/output",
    summary="Follow a process's output as NDJSON",
    response_class=StreamingResponse,
    responses=NDJSON,
)
async def process_output(
    pid: int,
    session: SessionDep,
    service: ServiceDep,
    replay: Annotated[
        bool, Query(description="First the most recent output kept (up to 256 KiB).")
    ] = False,
) -> StreamingResponse:
    """As `commands/stream`, without `start`: output from now on (or replayed first), then
    `end` with its result. Closing the connection leaves the process running."""
    await service.runs.process_info(session, pid)  # a wrong pid is a 404 before the stream starts
    lines = _ndjson(service, session, pid, replay=replay, start=False)
    return StreamingResponse(lines, media_type="application/x-ndjson")


@router.post(
    "/processes/{pid}/stdin",
    status_code=204,
    summary="Send bytes to a process's stdin (or its terminal)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
)
async def send_stdin(
    pid: int, request: Request, session: SessionDep, service: ServiceDep
) -> Response:
    """The body, raw, as it is (at most the service's request size limit). The process must
    have been started with `stdin: true` or a terminal."""
    data = await request.body()
    await service.runs.send_input(session, pid, data)
    return Response(status_code=204)


@router.post("/processes/{pid}/stdin/close", status_code=204, summary="Close a process's stdin")
async def close_stdin(pid: int, session: SessionDep, service: ServiceDep) -> Response:
    """It reads end-of-file."""
    await service.runs.close_input(session, pid)
    return Response(status_code=204)


@router.post("/processes/{pid}/signal", status_code=204, summary="Send a signal to a process")
async def send_signal(
    pid: int, body: SignalRequest, session: SessionDep, service: ServiceDep
) -> Response:
    """To the process and everything it started. Only the signals listed are sent; others are
    refused with 400."""
    await service.runs.signal_process(session, pid, signal_number(body.signal))
    return Response(status_code=204)


@router.post(
    "/processes/{pid}/wait",
    summary="Wait for a process to end; its result",
    response_model=CommandResult,
)
async def wait_process(
    pid: int, request: Request, session: SessionDep, service: ServiceDep
) -> Response:
    """A caller that disconnects stops waiting; the process runs on."""
    result = await unless_disconnected(request, service.runs.wait_process(session, pid))
    return await json_response(result)


@router.post("/processes/{pid}/resize", status_code=204, summary="Resize a process's terminal")
async def resize(
    pid: int, body: TerminalSize, session: SessionDep, service: ServiceDep
) -> Response:
    await service.runs.resize_terminal(session, pid, body)
    return Response(status_code=204)


# --- a terminal over a WebSocket
TERMINAL_PROTOCOL = """A WebSocket (`ws://.../v1/sessions/{id}/terminal?cols=80&rows=24`) that
runs `bash -i -l` in a terminal in the session's sandbox.

- Auth: `Authorization: Bearer <key>` on the upgrade request; a client that cannot set headers
  (a browser) sends `{"type": "auth", "key": "<key>"}` as its first text frame, within
  terminal_auth_timeout_s (10 s; or http_header_timeout_s if shorter).
- Binary frames from the client are keystrokes; binary frames to it are the terminal's output.
- Text frames from the client are control messages: `{"type": "resize", "cols": C, "rows": R}`.
  Text frames to it: `{"type": "dropped", ...}` if it read too slowly, `{"type": "error", ...}`
  for a control message that failed, and last `{"type": "end", "exit_code", "signal", ...}`.
- The socket closes with code 1000 when the shell ends; closing it kills the shell and what it
  started. Refusals close with 4000 + the HTTP status (4401, 4404, ...) after an `error` frame.
"""


class _Refused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@router.get(
    "/terminal",
    summary="A terminal over a WebSocket (this plain GET answers 426)",
    description=TERMINAL_PROTOCOL,
    status_code=426,
    responses={426: {"description": "Connect with a WebSocket upgrade."}},
)
async def terminal_without_upgrade(session: SessionDep) -> Response:
    raise HTTPException(426, "connect to this path with a WebSocket upgrade (see its description)")


@router.websocket("/terminal")
async def terminal(
    websocket: WebSocket,
    session_id: str,
    cols: Annotated[int, Query(ge=1, le=1000)] = 80,
    rows: Annotated[int, Query(ge=1, le=1000)] = 24,
) -> None:
    service: Service = websocket.app.state.service
    authenticate: Authenticator = websocket.app.state.authenticate
    sending = asyncio.Lock()  # the two pumps below both send
    try:
        if websocket.headers.get("authorization") is not None or authenticate.disabled:
            # Proven before the socket is accepted: until then (and while a browser's first
            # frame is awaited) the server may close it to make room for others.
            owner = _header_owner(websocket, authenticate)
            caller_proven(websocket.scope)
            await websocket.accept()
        else:
            await websocket.accept()
            fronts: FrontConfig = websocket.app.state.fronts
            wait = min(fronts.terminal_auth_timeout_s, fronts.http_header_timeout_s)
            owner = await _first_frame_owner(websocket, authenticate, wait)
            caller_proven(websocket.scope)
        session = await service.lifecycle.get(session_id, owner)
        request = ProcessRequest(
            argv=TERMINAL_SHELL,
            env=TERMINAL_ENV,
            stdin=True,
            terminal=TerminalSize(cols=cols, rows=rows),
            tag="terminal",
        )
        info = await service.runs.start_process(session, request)
    except WebSocketDisconnect:
        return
    except (_Refused, SessionError, SandboxError, HTTPException) as exc:
        if websocket.client_state is WebSocketState.CONNECTING:
            await websocket.accept()  # to say why in an error frame
        await _refuse(websocket, _refusal(exc))
        return
    await _run_terminal(websocket, service, session, info.pid, sending)


async def _run_terminal(
    websocket: WebSocket, service: Service, session: Session, pid: int, sending: asyncio.Lock
) -> None:
    """Output out and keystrokes in until the shell ends (close 1000) or the client leaves
    (the shell is killed). Waiting for its end keeps the session in use while it is open."""
    waiter = asyncio.ensure_future(service.runs.wait_process(session, pid))
    output = asyncio.ensure_future(_terminal_output(websocket, service, session, pid, sending))
    keys = asyncio.ensure_future(_terminal_input(websocket, service, session, pid, sending))
    try:
        done, _ = await asyncio.wait({output, keys}, return_when=asyncio.FIRST_COMPLETED)
        if output in done and output.exception() is None:
            keys.cancel()
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await websocket.close(code=1000)
    finally:
        for task in (output, keys, waiter):
            task.cancel()
        await asyncio.gather(output, keys, waiter, return_exceptions=True)
        await _kill(service, session, pid)


async def _terminal_output(
    websocket: WebSocket, service: Service, session: Session, pid: int, sending: asyncio.Lock
) -> None:
    events = await service.runs.process_events(session, pid, replay=True)
    try:
        async for event in events:
            async with sending:
                if isinstance(event, ProcessOutput):
                    await websocket.send_bytes(event.data)
                elif isinstance(event, Dropped):
                    dropped = {"type": "dropped", "chunks": event.chunks, "bytes": event.bytes}
                    await websocket.send_text(json.dumps(dropped))
                else:
                    await websocket.send_text(event.model_dump_json())
                    return
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()


async def _terminal_input(
    websocket: WebSocket, service: Service, session: Session, pid: int, sending: asyncio.Lock
) -> None:
    """Until the client leaves: keystrokes to the terminal, control messages acted on."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            if message.get("bytes") is not None:
                await service.runs.send_input(session, pid, message["bytes"])
            elif message.get("text") is not None:
                await _control(message["text"], service, session, pid)
        except (SandboxError, SessionError, OSError, ValueError) as exc:
            error = {"type": "error", "error": {"type": type(exc).__name__, "message": str(exc)}}
            async with sending:
                await websocket.send_text(json.dumps(error))


async def _control(text: str, service: Service, session: Session, pid: int) -> None:
    try:
        message = json.loads(text)
    except json.JSONDecodeError:
        message = None
    if not isinstance(message, dict) or message.get("type") != "resize":
        raise ValueError(
            'text frames are control messages ({"type": "resize", "cols": C, "rows": R}); '
            "send keystrokes as binary frames"
        )
    try:
        size = TerminalSize(cols=message.get("cols"), rows=message.get("rows"))
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"]
        raise ValueError(f"a resize needs cols and rows from 1 to 1000: {problem}") from None
    await service.runs.resize_terminal(session, pid, size)


def _header_owner(websocket: WebSocket, authenticate: Authenticator) -> str:
    """The caller's owner id, from the Authorization header (or none needed)."""
    header = websocket.headers.get("authorization")
    if header is None:  # auth is disabled
        return authenticate.owner_for_key("")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        raise _Refused(401, "Unauthorized", "send 'Authorization: Bearer <key>'")
    return authenticate.owner_for_key(key, client_address(websocket))


async def _first_frame_owner(
    websocket: WebSocket, authenticate: Authenticator, wait_s: float
) -> str:
    """The caller's owner id, from a first `auth` frame (browsers cannot set headers)."""
    client = client_address(websocket)
    try:
        message = await asyncio.wait_for(websocket.receive(), wait_s)
    except TimeoutError:
        raise _Refused(401, "Unauthorized", _no_key(wait_s)) from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    try:
        frame = json.loads(message.get("text") or "")
    except json.JSONDecodeError:
        frame = None
    if not isinstance(frame, dict) or frame.get("type") != "auth" or not frame.get("key"):
        raise _Refused(401, "Unauthorized", _no_key(wait_s))
    return authenticate.owner_for_key(str(frame["key"]), client)


def _no_key(wait_s: float) -> str:
    return (
        "missing API key: send 'Authorization: Bearer <key>', or first a text frame "
        f'{{"type": "auth", "key": "<key>"}} within {wait_s:g} s'
    )


def _refusal(exc: Exception) -> _Refused:
    if isinstance(exc, _Refused):
        return exc
    if isinstance(exc, HTTPException):  # WrongKeysThrottled names its own kind
        return _Refused(exc.status_code, getattr(exc, "kind", "Unauthorized"), str(exc.detail))
    if isinstance(exc, SessionError):
        return _Refused(exc.status, type(exc).__name__, str(exc))
    return _Refused(status_of(exc) or 500, type(exc).__name__, str(exc))


async def _refuse(websocket: WebSocket, refused: _Refused) -> None:
    """An `error` frame with the whole reason, then a close with 4000 + the HTTP status."""
    if websocket.client_state is not WebSocketState.CONNECTED:
        return
    error = {"type": "error", "error": {"type": refused.kind, "message": str(refused)}}
    reason = str(refused).encode()[:CLOSE_REASON_BYTES].decode(errors="ignore")
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await websocket.send_text(json.dumps(error))
        await websocket.close(code=4000 + refused.status, reason=reason)
