"""One stateful sandbox session behind an agent framework's tool, made on first use.

A tool object lives as long as the agent, so it holds a session rather than a sandbox: the
sandbox starts with the first call and keeps variables and files between calls. Two kinds:
`embedded` runs a session of an in-process service (no server to run; needs the `server` extra),
`remote` uses a session of a code-interpreter service over HTTP. The embedded kind is the
server's (orchestrator/embedded_session.py), found by the package entry point named
`embedded` in the group `code_interpreter_client.sessions`: this package never imports the
server, so a client-only install has none of it.

Frameworks call tools from their own event loops and threads (LangChain's sync `_run`, the Agents
SDK's runner), while a sandbox belongs to the loop that made it. So every call runs on the
shared loop of `code_interpreter_wire.background_loop`, and one CodeSession serves sync and async
callers alike.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.metadata
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
from pydantic import TypeAdapter

from code_interpreter_client.http_client import APIError, AsyncClient
from code_interpreter_wire.background_loop import run_in_background, run_sync
from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessInfo,
    ProcessOutput,
    ProcessRequest,
)
from code_interpreter_wire.rest import ExecutionRecord, SessionInfo, SnapshotInfo
from code_interpreter_wire.results import EventSink, Execution, FileInfo, OutputEvent
from code_interpreter_wire.server_extra import (
    INSTALL_SERVER,
    missing_server_module,
    server_extra_hint,
)
from code_interpreter_wire.spec import SandboxSpec
from code_interpreter_wire.tool_output import RenderedOutput, render

T = TypeVar("T")
# Where the server's session kinds are found (pyproject.toml's entry points), and the embedded one.
SESSIONS_GROUP = "code_interpreter_client.sessions"
EMBEDDED = "embedded"
# A backend the caller holds (a `sandbox.backends.base.Backend`), handed on to the embedded
# session as it is: the client does not import the server to name its type.
HeldBackend = Any
DEFAULT_MAX_CHARS = 20_000  # what a model is shown of one call's text
# The stream's lines that are output events (the others: keepalive, dropped, done, failure).
_EVENT_TYPES = ("stdout", "stderr", "result", "error")
_EVENTS: TypeAdapter[OutputEvent] = TypeAdapter(OutputEvent)
# What a process's follower is handed: its output as it comes, then its end.
ProcessStreamEvent = ProcessOutput | ProcessEnd
# Awaited with each chunk of a command's output as it comes (a gap said by `dropped_marker`).
CommandOutputSink = Callable[[ProcessOutput], Awaitable[None]]


def dropped_marker(count: int) -> ProcessOutput:
    """Output a follower missed (it read more slowly than the process wrote), said in place."""
    return ProcessOutput(
        stream="stdout",
        data=f"\n[... {count} bytes of output dropped: read too slowly ...]\n".encode(),
    )


class CodeSession(ABC):
    """`await session.execute(code)`, or `session.execute_sync(code)`, in one lasting sandbox."""

    def __init__(self, *, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._lock: asyncio.Lock | None = None  # made on the background loop, on first use

    @staticmethod
    def embedded(
        backend: str | HeldBackend = "local", spec: SandboxSpec | None = None, **config: Any
    ) -> CodeSession:
        """A session of a service in this process: on `local` (bubblewrap) or `docker` with
        backend config, or on a backend you hold (and close yourself). Needs the server extra."""
        session = _embedded_factory()(backend, spec, config)
        if not isinstance(session, CodeSession):
            raise TypeError(f"the {EMBEDDED!r} session kind made a {type(session).__name__}")
        return session

    @staticmethod
    def for_process() -> CodeSession:
        """A tool's default: an embedded local session, closed when the process exits."""
        session = CodeSession.embedded()
        # Not atexit: by then the thread pools that closing a sandbox uses are shut down. This
        # hook (the one concurrent.futures itself uses) runs first, while the pools still work.
        register = getattr(threading, "_register_atexit", atexit.register)
        register(session.close_sync)
        return session

    @staticmethod
    def remote(
        base_url: str,
        api_key: str | None,
        session_id: str | None = None,
        *,
        network: str | list[str] | dict[str, Any] | None = None,
        snapshot_id: str | None = None,
    ) -> RemoteSession:
        """A session of a running service; a new one unless `session_id` names one to reuse
        (a paused one wakes on its first call). `network`: the new session's network policy
        ('none', 'any', allowed hosts; within the service's ceiling: docs/network.md), else the
        service's default. `snapshot_id`: the new session starts from that snapshot's variables
        and files."""
        return RemoteSession(
            base_url, api_key, session_id, network=network, snapshot_id=snapshot_id
        )

    # --- what subclasses provide, all run on the background loop
    @property
    @abstractmethod
    def session_id(self) -> str | None:
        """The session's id once it has started."""

    @abstractmethod
    async def _start(self) -> None: ...

    @abstractmethod
    async def _execute(
        self, code: str, timeout_s: float | None, on_event: EventSink | None, language: str | None
    ) -> Execution: ...

    @abstractmethod
    async def _languages(self) -> list[str]:
        """The languages the session has (or, not started yet, would have), Python first."""

    @abstractmethod
    async def _upload(self, path: str, data: bytes) -> FileInfo: ...

    @abstractmethod
    async def _download(self, path: str) -> bytes: ...

    @abstractmethod
    async def _list_files(self, path: str) -> list[FileInfo]: ...

    @abstractmethod
    async def _close(self) -> None: ...

    @abstractmethod
    async def _run_command(
        self, request: ProcessRequest, on_output: CommandOutputSink | None
    ) -> CommandResult: ...

    @abstractmethod
    async def _start_process(self, request: ProcessRequest) -> ProcessInfo: ...

    @abstractmethod
    def _process_events(self, pid: int, replay: bool) -> AsyncIterator[ProcessStreamEvent]: ...

    @abstractmethod
    async def _send_input(self, pid: int, data: bytes) -> None: ...

    @abstractmethod
    async def _signal_process(self, pid: int, signum: int) -> None: ...

    @abstractmethod
    async def _wait_process(self, pid: int) -> CommandResult: ...

    def _full_output_url(self, execution: Execution) -> str | None:
        return None

    # --- the public calls
    async def _started(self, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.session_id is None:
                await self._start()
        return await call()

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_event: EventSink | None = None,
        language: str | None = None,
    ) -> Execution:
        """Run code in the session's kernel of `language` (None: Python; aliases such as `js`
        are accepted); `on_event` is awaited with each output event as it happens (on the
        shared background loop, not the caller's). A language the session does not have is a
        `LanguageUnavailable` (embedded) or a 400 `APIError` (remote) naming those it has."""
        return await run_in_background(
            self._started(lambda: self._execute(code, timeout_s, on_event, language))
        )

    def execute_sync(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_event: EventSink | None = None,
        language: str | None = None,
    ) -> Execution:
        return run_sync(self._started(lambda: self._execute(code, timeout_s, on_event, language)))

    async def languages(self) -> list[str]:
        """The languages `execute` takes here, Python first; asked without starting a sandbox
        when the session has not started (what a tool's description lists)."""
        return await run_in_background(self._languages())

    def languages_sync(self) -> list[str]:
        return run_sync(self._languages())

    def offered_languages(self) -> list[str]:
        """What a tool built on this session offers a model: its languages, or Python alone
        when they cannot be known now (a sandbox that cannot start, a service out of reach,
        a session id that is wrong); the tool's first call then says what is wrong."""
        try:
            return self.languages_sync()
        except (SandboxError, APIError, httpx.HTTPError, OSError):
            return [PYTHON]

    async def upload(self, path: str, data: bytes) -> FileInfo:
        return await run_in_background(self._started(lambda: self._upload(path, data)))

    async def download(self, path: str) -> bytes:
        return await run_in_background(self._started(lambda: self._download(path)))

    async def list_files(self, path: str = "") -> list[FileInfo]:
        return await run_in_background(self._started(lambda: self._list_files(path)))

    async def start(self) -> str:
        """Start the session now (the first call otherwise does); its id."""

        async def session_id() -> str:
            assert self.session_id is not None
            return self.session_id

        return await run_in_background(self._started(session_id))

    # --- processes beside the kernel, in the same sandbox (sandbox/processes/)
    async def run_command(
        self, request: ProcessRequest, *, on_output: CommandOutputSink | None = None
    ) -> CommandResult:
        """Run a command (argv, or a shell line as `command`) to its end; leaving early kills
        it. `on_output` is awaited with its output as it comes (on the shared background
        loop, not the caller's)."""
        return await run_in_background(self._started(lambda: self._run_command(request, on_output)))

    def run_command_sync(
        self, request: ProcessRequest, *, on_output: CommandOutputSink | None = None
    ) -> CommandResult:
        return run_sync(self._started(lambda: self._run_command(request, on_output)))

    async def start_process(self, request: ProcessRequest) -> ProcessInfo:
        """Start a process that runs on in the background (a server, a terminal...)."""
        return await run_in_background(self._started(lambda: self._start_process(request)))

    async def process_events(
        self, pid: int, *, replay: bool = False
    ) -> AsyncIterator[ProcessStreamEvent]:
        """A process's output from now on (`replay`: the most recent kept first), then its
        end. Read on the shared background loop and handed over one event at a time; leaving
        early stops following (the process runs on)."""

        async def opened() -> AsyncIterator[ProcessStreamEvent]:
            return self._process_events(pid, replay)

        events = await run_in_background(self._started(opened))
        try:
            while (event := await run_in_background(_next_or_none(events))) is not None:
                yield event
        finally:
            await run_in_background(_close_iterator(events))

    async def send_input(self, pid: int, data: bytes) -> None:
        """Write to a process's stdin (its terminal, for one in a terminal)."""
        await run_in_background(self._started(lambda: self._send_input(pid, data)))

    async def signal_process(self, pid: int, signum: int) -> None:
        """Send a signal to a process and everything it started."""
        await run_in_background(self._started(lambda: self._signal_process(pid, signum)))

    async def wait_process(self, pid: int) -> CommandResult:
        """Wait for a process's end: its exit and its output, within the output limits."""
        return await run_in_background(self._started(lambda: self._wait_process(pid)))

    def render(self, execution: Execution, language: str | None = None) -> RenderedOutput:
        """The execution as a model should read it: trimmed text, plus its images."""
        return render(
            execution,
            language=language,
            session_id=self.session_id or "",
            max_chars=self.max_chars,
            full_output_url=self._full_output_url(execution),
            artifact_urls={},
        )

    async def close(self) -> None:
        """End the session (a remote one only if this object started it)."""
        await run_in_background(self._close())

    def close_sync(self) -> None:
        run_sync(self._close())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close_sync()


def _embedded_factory() -> Any:
    """The server's embedded session class, loaded by its entry point; a client-only install
    (or an install without the entry point) is told what to install."""
    found = importlib.metadata.entry_points(group=SESSIONS_GROUP, name=EMBEDDED)
    if not found:
        raise ModuleNotFoundError(
            f"CodeSession.embedded needs the server, which declares the {EMBEDDED!r} entry point "
            f"of {SESSIONS_GROUP!r}; none is installed: {INSTALL_SERVER}"
        )
    try:
        return next(iter(found)).load()
    except ModuleNotFoundError as exc:  # a client-only install: say what to install
        module = missing_server_module(exc)
        if module is None:
            raise
        hint = server_extra_hint("CodeSession.embedded", module)
        raise ModuleNotFoundError(hint, name=exc.name) from None


async def _next_or_none(events: AsyncIterator[T]) -> T | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def _close_iterator(events: AsyncIterator[T]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


class RemoteSession(CodeSession):
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        session_id: str | None,
        *,
        owned: bool | None = None,
        network: str | list[str] | dict[str, Any] | None = None,
        snapshot_id: str | None = None,
        **kw: Any,
    ) -> None:
        """`owned`: whether closing this object ends the session (by default, only a session
        this object made is ended by it). `network`: the policy of a session it makes;
        `snapshot_id`: the snapshot it starts from."""
        super().__init__(**kw)
        if session_id is not None and snapshot_id is not None:
            raise ValueError(
                "a snapshot starts a new session: give `session_id` (to reuse a session) or "
                "`snapshot_id` (to start one from a snapshot), not both"
            )
        self._network = network
        self._snapshot_id = snapshot_id
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._id = session_id
        self._owned = session_id is None if owned is None else owned
        self._api: AsyncClient | None = None

    @property
    def session_id(self) -> str | None:
        return self._id if self._api is not None else None

    @property
    def api(self) -> AsyncClient:
        if self._api is None:
            raise RuntimeError("the client starts with the first call")
        return self._api

    async def _start(self) -> None:
        api = AsyncClient(self.base_url, self._api_key)
        try:
            if self._id is None:
                body: dict[str, Any] = {} if self._network is None else {"network": self._network}
                if self._snapshot_id is not None:
                    body["snapshot_id"] = self._snapshot_id
                self._id = (await api.create_session(**body)).id
            else:
                await api.get_session(self._id)  # fails early on a wrong or expired id
        except BaseException:
            await api.close()
            raise
        self._api = api

    def _sid(self) -> str:
        assert self._id is not None
        return self._id

    async def _execute(
        self, code: str, timeout_s: float | None, on_event: EventSink | None, language: str | None
    ) -> Execution:
        options: dict[str, Any] = {"timeout_s": timeout_s} if timeout_s is not None else {}
        if language is not None:
            options["language"] = language
        if on_event is None:
            return await self.api.execute(self._sid(), code, **options)
        async for line in self.api.execute_stream(self._sid(), code, **options):
            kind = line.get("type")
            if kind == "done":
                return ExecutionRecord.model_validate(line["execution"])
            if kind == "failure":
                error = line.get("error", {})
                raise APIError(410, str(error.get("type")), str(error.get("message")))
            if kind in _EVENT_TYPES:
                await on_event(_EVENTS.validate_python(line))
        raise APIError(502, "StreamEnded", "the stream ended before the execution did")

    async def _languages(self) -> list[str]:
        if self._api is not None and self._id is not None:
            return (await self._api.get_session(self._id)).languages
        async with AsyncClient(self.base_url, self._api_key) as api:
            if self._id is not None:  # the session to reuse: its own
                return (await api.get_session(self._id)).languages
            return (await api.languages()).languages

    def _full_output_url(self, execution: Execution) -> str | None:
        execution_id = getattr(execution, "execution_id", None)
        if execution_id is None:
            return None
        return f"{self.base_url}/v1/sessions/{self._sid()}/executions/{execution_id}"

    async def _upload(self, path: str, data: bytes) -> FileInfo:
        return await self.api.upload(self._sid(), path, data)

    async def _download(self, path: str) -> bytes:
        return await self.api.download(self._sid(), path)

    async def _list_files(self, path: str) -> list[FileInfo]:
        return await self.api.list_files(self._sid(), path)

    async def _run_command(
        self, request: ProcessRequest, on_output: CommandOutputSink | None
    ) -> CommandResult:
        if on_output is None:
            return await self.api.run_command(self._sid(), request)
        # The stream route follows it from its first byte and kills it if this call leaves.
        async for line in self.api.run_command_stream(self._sid(), request):
            kind = line.get("type")
            if kind in ("stdout", "stderr", "pty"):
                await on_output(ProcessOutput(stream=kind, data=str(line.get("text", "")).encode()))
            elif kind == "dropped":
                await on_output(dropped_marker(int(line.get("bytes", 0))))
            elif kind == "end":
                return CommandResult.model_validate(line["result"])
        raise APIError(502, "StreamEnded", "the stream ended before the command did")

    async def _start_process(self, request: ProcessRequest) -> ProcessInfo:
        return await self.api.start_process(self._sid(), request)

    async def _process_events(self, pid: int, replay: bool) -> AsyncIterator[ProcessStreamEvent]:
        # The API streams output as text (decoded per stream); it goes on as UTF-8 bytes.
        async for line in self.api.process_output(self._sid(), pid, replay=replay):
            kind = line.get("type")
            if kind in ("stdout", "stderr", "pty"):
                yield ProcessOutput(stream=kind, data=str(line.get("text", "")).encode())
            elif kind == "dropped":
                yield dropped_marker(int(line.get("bytes", 0)))
            elif kind == "end":
                result = CommandResult.model_validate(line["result"])
                yield ProcessEnd(
                    exit_code=result.exit_code,
                    signal=result.signal,
                    timed_out=result.timed_out,
                    error=result.error,
                )
                return

    async def _send_input(self, pid: int, data: bytes) -> None:
        await self.api.send_stdin(self._sid(), pid, data)

    async def _signal_process(self, pid: int, signum: int) -> None:
        await self.api.signal_process(self._sid(), pid, signum)

    async def _wait_process(self, pid: int) -> CommandResult:
        return await self.api.wait_process(self._sid(), pid)

    # --- pause, resume and snapshots (the service keeps variables and files)
    async def pause(self) -> SessionInfo:
        """Save the session's variables and files and stop its sandbox: it holds no process,
        and outlives this process. The next call (or `resume`) brings it back."""
        return await run_in_background(self._started(lambda: self.api.pause(self._sid())))

    def pause_sync(self) -> SessionInfo:
        return run_sync(self._started(lambda: self.api.pause(self._sid())))

    async def resume(self) -> str | None:
        """Wake the paused session now (the next call otherwise does); the notice of what
        came back and what did not (None when there is nothing to say)."""
        return await run_in_background(self._started(self._resume))

    def resume_sync(self) -> str | None:
        return run_sync(self._started(self._resume))

    async def _resume(self) -> str | None:
        return (await self.api.resume(self._sid())).notice

    async def state(self) -> SessionInfo:
        """The session's info without waking it: `state` is `running` or `paused`."""
        return await run_in_background(self._started(lambda: self.api.get_session(self._sid())))

    async def snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Save the session's variables and files as a snapshot (named `name`); new sessions
        start from it with `CodeSession.remote(..., snapshot_id=info.id)`. The session runs on."""
        return await run_in_background(self._started(lambda: self.api.snapshot(self._sid(), name)))

    def snapshot_sync(self, name: str | None = None) -> SnapshotInfo:
        return run_sync(self._started(lambda: self.api.snapshot(self._sid(), name)))

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot of this API key, newest first."""
        async with AsyncClient(self.base_url, self._api_key) as api:
            return await api.list_snapshots()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        async with AsyncClient(self.base_url, self._api_key) as api:
            await api.delete_snapshot(snapshot_id)

    def disown(self) -> None:
        """Closing this object will leave the session to the service (paused, say) rather
        than end it."""
        self._owned = False

    async def _close(self) -> None:
        api, self._api = self._api, None
        if api is None:
            return
        try:
            if self._owned and self._id is not None:
                await api.delete_session(self._id)
                self._id = None
        finally:
            await api.close()
