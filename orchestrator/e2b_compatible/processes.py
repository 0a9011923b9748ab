"""E2B's process service (envd's Connect RPC `process.Process`) over the session's processes.

Served by the SDK's own generated Connect application, so `commands.*`, `pty.*` and `git.*` of
E2B's SDK speak to it unchanged. Everything goes through `Service`'s process methods, so a
process here is the same as one started through /v1: inside the sandbox, with its limits, its
output kept within caps.

As envd does: the start event comes first; then output chunks, a keepalive after each
`Keepalive-Ping-Interval` seconds without output; then one end event (exit code -1 when a signal
ended it). The call's deadline (`Connect-Timeout-Ms`) is the process's time limit: one killed
at it ends that call's stream with `deadline_exceeded`, as envd's does (E2B's SDK raises its
TimeoutException, whichever of the two clocks runs out first; a `connect` to it gets its end
event, exit -1); a client that
disconnects does not kill it (a background command goes on). What a stream may queue for a slow
reader is capped by the process's listener backlog: past it, chunks are dropped and a note on
stderr says how many bytes.

E2B's `user`: no user, `user` (E2B's default) and the sandbox's own name run as the sandbox's
unprivileged user; `root` runs as root where the sandbox has one (a gVisor machine), and is
refused with the reason and the way out elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Literal, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect
from e2b.envd.process.process_pb import (
    PTY,
    CloseStdinRequest,
    CloseStdinResponse,
    ConnectRequest,
    ConnectResponse,
    ListRequest,
    ListResponse,
    ProcessConfig,
    ProcessEvent,
    ProcessInfo,
    ProcessSelector,
    SendInputRequest,
    SendInputResponse,
    SendSignalRequest,
    SendSignalResponse,
    Signal,
    StartRequest,
    StartResponse,
    StreamInputRequest,
    StreamInputResponse,
    UpdateRequest,
    UpdateResponse,
)
from protobuf import Oneof

from code_interpreter_wire.errors import ProcessNotFound
from code_interpreter_wire.processes import ProcessEnd, ProcessOutput, ProcessRequest, TerminalSize
from orchestrator.e2b_compatible.connect_calls import call, connect_errors, session_for
from orchestrator.e2b_compatible.paths import to_sandbox_cwd
from orchestrator.e2b_compatible.sandboxes import E2BSandboxes
from orchestrator.sessions import Session
from sandbox.processes.managed import Dropped
from sandbox.processes.managed import ProcessEvent as OurEvent

# The users a process may ask for: E2B's default name, and the sandbox's own (Docker's image).
SANDBOX_USERS = frozenset({"user", "sandbox"})
# Processes the front starts for itself (file transfers outside the workspace): not listed.
INTERNAL_TAG = "cir-e2b-internal:"
DEFAULT_KEEPALIVE_S = 90.0  # envd's, when the client sends no Keepalive-Ping-Interval
KEEPALIVE_BOUNDS_S = (1.0, 300.0)
REMEMBERED_CONFIGS = 1024  # the configs List reports, as requested (oldest forgotten first)
REMEMBERED_CONFIG_BYTES = 16 << 20  # and their size in all
_SIGNALS = {Signal.SIGKILL: signal.SIGKILL, Signal.SIGTERM: signal.SIGTERM}
T = TypeVar("T")


class SandboxProcesses(process_connect.Process):
    """The Process service, one for the front; each call finds its sandbox by its headers."""

    def __init__(self, sandboxes: E2BSandboxes) -> None:
        self.sandboxes = sandboxes
        self.service = sandboxes.service
        # (session id, pid) -> the config as the client sent it (List reports it back).
        self._configs: OrderedDict[tuple[str, int], ProcessConfig] = OrderedDict()
        self._config_sizes: dict[tuple[str, int], int] = {}

    async def _session(self, ctx: RequestContext[Any, Any]) -> Session:
        return await session_for(self.sandboxes, ctx)

    # --- starting and following
    def start(
        self, request: StartRequest, ctx: RequestContext[StartRequest, StartResponse], /
    ) -> AsyncIterator[StartResponse]:
        return self._start(request, ctx)

    async def _start(
        self, request: StartRequest, ctx: RequestContext[StartRequest, StartResponse]
    ) -> AsyncIterator[StartResponse]:
        user = check_user(ctx.request_headers.get("authorization"))
        session = await self._session(ctx)
        wanted = _process_request(request, ctx.timeout_ms)
        if user == "root":  # where the sandbox has none, the service refuses it, saying why
            wanted = wanted.model_copy(update={"user": "root"})
        info = await call(_within_deadline(self.service.runs.start_process(session, wanted), ctx))
        if request.process is not None:
            self._remember(session.id, info.pid, request.process)
        events = await self.service.runs.process_events(session, info.pid, replay=True)
        keepalive_s = _keepalive_s(ctx)
        async for event in _envd_events(info.pid, events, keepalive_s, started_here=True):
            yield StartResponse(event=event)

    def connect(
        self, request: ConnectRequest, ctx: RequestContext[ConnectRequest, ConnectResponse], /
    ) -> AsyncIterator[ConnectResponse]:
        return self._connect(request, ctx)

    async def _connect(
        self, request: ConnectRequest, ctx: RequestContext[ConnectRequest, ConnectResponse]
    ) -> AsyncIterator[ConnectResponse]:
        session = await self._session(ctx)
        pid = await self._pid(session, request.process)
        # envd gives a live process's output from now on; an ended one's start and end.
        events = await self.service.runs.process_events(session, pid, replay=False)
        async for event in _envd_events(pid, events, _keepalive_s(ctx)):
            yield ConnectResponse(event=event)

    async def list(
        self, request: ListRequest, ctx: RequestContext[ListRequest, ListResponse], /
    ) -> ListResponse:
        session = await self._session(ctx)
        listed = []
        with connect_errors():
            running = await self.service.runs.list_processes(session)
        live = {info.pid for info in running}
        for key in [k for k in self._configs if k[0] == session.id and k[1] not in live]:
            self._forget(key)  # ended: List no longer reports it
        for info in running:
            if info.tag is not None and info.tag.startswith(INTERNAL_TAG):
                continue
            config = self._configs.get((session.id, info.pid)) or ProcessConfig(
                cmd=info.argv[0], args=info.argv[1:], envs=info.env, cwd=info.cwd
            )
            listed.append(ProcessInfo(config=config, pid=info.pid, tag=info.tag))
        return ListResponse(processes=listed)

    # --- input, signals, terminal size
    async def send_input(
        self, request: SendInputRequest, ctx: RequestContext[SendInputRequest, SendInputResponse], /
    ) -> SendInputResponse:
        session = await self._session(ctx)
        pid = await self._pid(session, request.process)
        await call(self.service.runs.send_input(session, pid, _input_bytes(request.input)))
        return SendInputResponse()

    async def stream_input(
        self,
        request: AsyncIterator[StreamInputRequest],
        ctx: RequestContext[StreamInputRequest, StreamInputResponse],
        /,
    ) -> StreamInputResponse:
        """The first message names the process; each later one is input, sent as it arrives
        (RequestGuard passes this body through as it comes)."""
        session = await self._session(ctx)
        pid: int | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=StreamInputRequest.StartEvent() as start):
                    pid = await self._pid(session, start.process)
                case Oneof(field="data", value=StreamInputRequest.DataEvent() as data):
                    if pid is None:
                        raise ConnectError(
                            Code.INVALID_ARGUMENT, "the first message must name the process"
                        )
                    await call(self.service.runs.send_input(session, pid, _input_bytes(data.input)))
                case _:  # keepalive
                    pass
        return StreamInputResponse()

    async def send_signal(
        self,
        request: SendSignalRequest,
        ctx: RequestContext[SendSignalRequest, SendSignalResponse],
        /,
    ) -> SendSignalResponse:
        session = await self._session(ctx)
        pid = await self._pid(session, request.process)
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "the signal must be SIGTERM or SIGKILL")
        await call(self.service.runs.signal_process(session, pid, signum))
        return SendSignalResponse()

    async def update(
        self, request: UpdateRequest, ctx: RequestContext[UpdateRequest, UpdateResponse], /
    ) -> UpdateResponse:
        session = await self._session(ctx)
        pid = await self._pid(session, request.process)
        size = request.pty.size if request.pty is not None else None
        if size is None:
            return UpdateResponse()  # nothing to change (envd does the same)
        with connect_errors():
            terminal = TerminalSize(cols=size.cols, rows=size.rows)
        await call(self.service.runs.resize_terminal(session, pid, terminal))
        return UpdateResponse()

    async def close_stdin(
        self,
        request: CloseStdinRequest,
        ctx: RequestContext[CloseStdinRequest, CloseStdinResponse],
        /,
    ) -> CloseStdinResponse:
        session = await self._session(ctx)
        pid = await self._pid(session, request.process)
        with connect_errors():
            if (await self.service.runs.process_info(session, pid)).terminal:
                raise ConnectError(
                    Code.FAILED_PRECONDITION,
                    "a terminal's input cannot be closed: send Ctrl-D (0x04) instead",
                )
        await call(self.service.runs.close_input(session, pid))
        return CloseStdinResponse()

    # --- helpers
    async def _pid(self, session: Session, selector: ProcessSelector | None) -> int:
        """The pid a selector names (by pid, or the newest process with that tag)."""
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=int(pid)):
                with connect_errors():
                    await self.service.runs.process_info(session, pid)
                return pid
            case Oneof(field="tag", value=str(tag)):
                with connect_errors():
                    found = [
                        p.pid
                        for p in await self.service.runs.list_processes(session, include_ended=True)
                        if p.tag == tag
                    ]
                    if not found:
                        raise ProcessNotFound(f"process with tag {tag} not found")
                return found[-1]
        raise ConnectError(Code.INVALID_ARGUMENT, "name the process by pid or tag")

    def _remember(self, session_id: str, pid: int, config: ProcessConfig) -> None:
        key = (session_id, pid)
        self._forget(key)
        self._configs[key] = config
        self._config_sizes[key] = (
            len(config.cmd)
            + sum(len(a) for a in config.args)
            + sum(len(k) + len(v) for k, v in config.envs.items())
            + len(config.cwd or "")
        )
        while len(self._configs) > REMEMBERED_CONFIGS or (
            sum(self._config_sizes.values()) > REMEMBERED_CONFIG_BYTES and len(self._configs) > 1
        ):
            self._forget(next(iter(self._configs)))

    def _forget(self, key: tuple[str, int]) -> None:
        self._configs.pop(key, None)
        self._config_sizes.pop(key, None)


def check_user(authorization: str | None) -> str | None:
    """The user a process asks for ("root", or None for the sandbox's own): E2B sends it as
    `Basic base64("<user>:")`. A user the sandbox does not have is refused."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None  # not E2B's user header; nothing here reads other credentials from it
    try:
        user = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.UNAUTHENTICATED, "the Authorization header is not valid") from None
    if user == "root":
        return "root"
    if user and user not in SANDBOX_USERS:
        raise ConnectError(
            Code.UNAUTHENTICATED,
            f"invalid username {user!r}: processes here run as the sandbox's own user or, "
            "where the sandbox has one (gvisor), as root; run it without `user`, with "
            "user='user' or user='root'",
        )
    return None


async def _within_deadline(starting: Awaitable[T], ctx: RequestContext[Any, Any]) -> T:
    """A start within the call's deadline. Its client gives up then (E2B's SDK at the command's
    `timeout`), unseen by this stream until it has something to send: a start still waiting for
    a human's approval is withdrawn, not left to start a process that no one follows."""
    left_ms = ctx.timeout_ms
    if left_ms is None:
        return await starting
    try:
        async with asyncio.timeout(max(0.0, left_ms) / 1000):
            return await starting
    except TimeoutError:
        raise ConnectError(
            Code.DEADLINE_EXCEEDED,
            "the command did not start within the call's timeout (a wait for a human's "
            "approval, if any, is withdrawn): give it a longer timeout",
        ) from None


def _process_request(request: StartRequest, timeout_ms: float | None) -> ProcessRequest:
    config = request.process
    if config is None or not config.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "the process config needs a cmd")
    terminal = _terminal_size(request.pty)
    # envd: stdin unset means open (older clients); a terminal always takes input.
    stdin = request.stdin if request.has_field("stdin") else True
    with connect_errors():
        return ProcessRequest(
            argv=[config.cmd, *config.args],
            env=dict(config.envs),
            cwd=to_sandbox_cwd(config.cwd) if config.has_field("cwd") else None,
            stdin=stdin or terminal is not None,
            timeout_s=timeout_ms / 1000 if timeout_ms and timeout_ms > 0 else None,
            terminal=terminal,
            tag=request.tag if request.has_field("tag") else None,
        )


def _terminal_size(pty: PTY | None) -> TerminalSize | None:
    if pty is None:
        return None
    size = pty.size
    with connect_errors():
        if size is None:
            return TerminalSize()
        return TerminalSize(cols=size.cols, rows=size.rows)


def _input_bytes(process_input: Any) -> bytes:
    match process_input.input if process_input is not None else None:
        case Oneof(field="stdin" | "pty", value=data):
            return bytes(data)
    raise ConnectError(Code.INVALID_ARGUMENT, "the input holds neither stdin nor pty bytes")


def _keepalive_s(ctx: RequestContext[Any, Any]) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        seconds = float(raw) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        seconds = DEFAULT_KEEPALIVE_S
    low, high = KEEPALIVE_BOUNDS_S
    return min(max(seconds, low), high)


async def _envd_events(
    pid: int, events: AsyncIterator[OurEvent], keepalive_s: float, *, started_here: bool = False
) -> AsyncIterator[ProcessEvent]:
    """envd's event sequence for a process: start, data and keepalives, end. The process's
    events are subscribed to before the start event goes out, so no output is missed.
    `started_here`: the stream of the call whose deadline was the process's time limit, which
    ends as envd's does past it (another stream reaching the process gets its end event)."""
    iterator = aiter(events)
    pending: asyncio.Future[OurEvent] = asyncio.ensure_future(anext(iterator))
    try:
        yield ProcessEvent(
            event=Oneof[Literal["start"], Any]("start", ProcessEvent.StartEvent(pid=pid))
        )
        while True:
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:  # quiet: a keepalive, which is also how a gone client is noticed
                yield ProcessEvent(
                    event=Oneof[Literal["keepalive"], Any]("keepalive", ProcessEvent.KeepAlive())
                )
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            if isinstance(event, ProcessEnd):
                if event.timed_out and started_here:  # envd's stream past its deadline
                    raise ConnectError(
                        Code.DEADLINE_EXCEEDED,
                        f"the command was {event.error or 'killed after its time limit'} (the "
                        "call's timeout): give it a longer timeout, or 0 for none",
                    )
                yield ProcessEvent(event=Oneof[Literal["end"], Any]("end", end_event(event)))
                return
            pending = asyncio.ensure_future(anext(iterator))
            yield ProcessEvent(event=Oneof[Literal["data"], Any]("data", _data_event(event)))
    finally:
        if not pending.done():
            pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        close = getattr(iterator, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


def _data_event(event: ProcessOutput | Dropped) -> ProcessEvent.DataEvent:
    if isinstance(event, Dropped):
        note = f"\n[{event.bytes} bytes of output dropped: the client read too slowly]\n"
        return ProcessEvent.DataEvent(
            output=Oneof[Literal["stderr"], bytes]("stderr", note.encode())
        )
    if event.stream == "stdout":
        return ProcessEvent.DataEvent(output=Oneof[Literal["stdout"], bytes]("stdout", event.data))
    if event.stream == "stderr":
        return ProcessEvent.DataEvent(output=Oneof[Literal["stderr"], bytes]("stderr", event.data))
    return ProcessEvent.DataEvent(output=Oneof[Literal["pty"], bytes]("pty", event.data))


def end_event(end: ProcessEnd) -> ProcessEvent.EndEvent:
    """envd's end: the exit code, or -1 and `exited` false when a signal ended it; `status` in
    Go's words, and `error` (whenever it did not exit 0) the same, with our reason added when
    there is one beyond the status (its time limit, a signal's cause)."""
    if end.exit_code is not None:
        status = f"exit status {end.exit_code}"
        if end.exit_code == 0:
            return ProcessEvent.EndEvent(exit_code=0, exited=True, status=status)
        error = f"{status}: {end.error}" if end.timed_out and end.error else status
        return ProcessEvent.EndEvent(
            exit_code=end.exit_code, exited=True, status=status, error=error
        )
    if end.signal is not None:
        try:
            name = signal.Signals(end.signal).name
        except ValueError:
            name = f"signal {end.signal}"
        status = f"signal: {'killed' if end.signal == signal.SIGKILL else name}"
    else:
        status = "unknown"
    error = f"{status}: {end.error}" if end.error else status
    return ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status, error=error)
