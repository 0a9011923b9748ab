"""A small Python client for the HTTP API: `AsyncClient`, and `Client` for blocking code.

async with AsyncClient("http://127.0.0.1:8000", api_key="...") as api:
    session = await api.create_session()
    execution = await api.execute(session.id, "1 + 1")
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import httpx

from code_interpreter_client.http_answers import APIError as APIError
from code_interpreter_client.http_answers import checked as _check
from code_interpreter_client.http_answers import file_path as _path
from code_interpreter_client.http_answers import segment as _segment
from code_interpreter_client.secret_calls import BlockingSecretCalls, SecretCalls
from code_interpreter_client.volume_calls import BlockingVolumeCalls, VolumeCalls
from code_interpreter_wire.background_loop import run_sync
from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest, TerminalSize
from code_interpreter_wire.rest import (
    ExecutionRecord,
    LanguagesResponse,
    NetworkReport,
    ResumeInfo,
    SessionInfo,
    SnapshotInfo,
)
from code_interpreter_wire.results import FileInfo

T = TypeVar("T")
# Waiting for a command or a process may outlast any read timeout: the service bounds it.
_NO_READ_TIMEOUT = httpx.Timeout(None, connect=30.0)
SessionState = Literal["running", "paused"]


class AsyncClient(VolumeCalls, SecretCalls):
    def __init__(
        self, base_url: str, api_key: str | None = None, *, timeout_s: float = 600.0
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s)
        self._api_key = api_key

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    # --- sessions
    async def create_session(self, **body: Any) -> SessionInfo:
        """`body`: the fields of POST /v1/sessions (`backend`, `network`, `snapshot_id` to start
        from a snapshot's variables and files, ...)."""
        return SessionInfo.model_validate(await self._json("POST", "/v1/sessions", json=body))

    async def get_session(self, session_id: str) -> SessionInfo:
        """The session's info; a paused one stays paused (its `state` says so)."""
        return SessionInfo.model_validate(
            await self._json("GET", f"/v1/sessions/{_segment(session_id)}")
        )

    async def list_sessions(self, state: SessionState | None = None) -> list[SessionInfo]:
        """The caller's sessions, running and paused; only those in `state` when given."""
        params = {"state": state} if state is not None else {}
        data = await self._json("GET", "/v1/sessions", params=params)
        return [SessionInfo.model_validate(s) for s in data]

    async def pause(self, session_id: str) -> SessionInfo:
        """Save the session's variables and files and stop its sandbox; the next call on it
        (or `resume`) brings them back. A 409 while it runs code."""
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/pause")
        return SessionInfo.model_validate(data)

    async def resume(self, session_id: str) -> ResumeInfo:
        """Wake a paused session now; its `notice` says what came back and what did not."""
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/resume")
        return ResumeInfo.model_validate(data)

    # --- snapshots: a session's variables and files, to start new sessions from
    async def snapshot(self, session_id: str, name: str | None = None) -> SnapshotInfo:
        """Save the running session's variables and files under `name`; it runs on."""
        body = {"name": name} if name is not None else {}
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/snapshots", json=body)
        return SnapshotInfo.model_validate(data)

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """The caller's snapshots, newest first."""
        return [SnapshotInfo.model_validate(s) for s in await self._json("GET", "/v1/snapshots")]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return SnapshotInfo.model_validate(
            await self._json("GET", f"/v1/snapshots/{_segment(snapshot_id)}")
        )

    async def delete_snapshot(self, snapshot_id: str) -> None:
        _check(await self.http.delete(f"/v1/snapshots/{_segment(snapshot_id)}"))

    async def delete_session(self, session_id: str) -> None:
        _check(await self.http.delete(f"/v1/sessions/{_segment(session_id)}"))

    async def keepalive(self, session_id: str) -> SessionInfo:
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/keepalive")
        return SessionInfo.model_validate(data)

    async def interrupt(self, session_id: str) -> bool:
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/interrupt")
        return bool(data["interrupted"])

    async def restart(self, session_id: str, language: str | None = None) -> SessionInfo:
        """A fresh kernel of `language`; every kernel the session started when None."""
        body = {"language": language} if language is not None else None
        data = await self._json("POST", f"/v1/sessions/{_segment(session_id)}/restart", json=body)
        return SessionInfo.model_validate(data)

    async def network(self, session_id: str, limit: int = 100) -> NetworkReport:
        """The session's network policy and its latest `limit` connections through its proxy."""
        data = await self._json(
            "GET", f"/v1/sessions/{_segment(session_id)}/network", params={"limit": limit}
        )
        return NetworkReport.model_validate(data)

    # --- inbound ports: servers the session's code started (a session created with `ports`)
    def port_url(self, session_id: str, port: int, path: str = "/") -> str:
        """The URL of `path` on the server the session's code runs on `port`. Reaching it
        takes your key as X-API-Key or the session's port token (`ports.token` of its info) as
        X-Port-Token, unless the session's ports are public (docs/ports.md)."""
        base = str(self.http.base_url).rstrip("/")
        return f"{base}/v1/sessions/{_segment(session_id)}/ports/{int(port)}/{path.lstrip('/')}"

    async def port_request(
        self, session_id: str, port: int, method: str, path: str = "/", **kwargs: Any
    ) -> httpx.Response:
        """A request to that server with this client's key (sent as X-API-Key: on these routes
        an Authorization header is the server's own, and goes on to it); `kwargs`: httpx's."""
        headers = {**kwargs.pop("headers", {}), "Authorization": ""}
        if self._api_key:
            headers["X-API-Key"] = self._api_key
        request = self.http.build_request(
            method, self.port_url(session_id, port, path), headers=headers, **kwargs
        )
        del request.headers["Authorization"]  # this client's own: never sent to a server
        return await self.http.send(request)

    async def languages(self) -> LanguagesResponse:
        """The languages this deployment's new sessions have, on each backend."""
        return LanguagesResponse.model_validate(await self._json("GET", "/v1/languages"))

    # --- execution
    async def execute(self, session_id: str, code: str, **options: Any) -> ExecutionRecord:
        """`options`: timeout_s, env, cwd, language (Python if unset)."""
        data = await self._json(
            "POST", f"/v1/sessions/{_segment(session_id)}/execute", json={"code": code, **options}
        )
        return ExecutionRecord.model_validate(data)

    async def execute_stream(
        self, session_id: str, code: str, **options: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield each NDJSON event (keepalives included); the last is `done`."""
        url = f"/v1/sessions/{_segment(session_id)}/execute/stream"
        async with self.http.stream("POST", url, json={"code": code, **options}) as response:
            if not response.is_success:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    # --- files
    async def upload(self, session_id: str, path: str, data: bytes) -> FileInfo:
        url = f"/v1/sessions/{_segment(session_id)}/files"
        response = await self.http.post(
            url, params={"path": path}, files={"file": (path.rsplit("/", 1)[-1], data)}
        )
        return FileInfo.model_validate(_check(response).json())

    async def list_files(
        self, session_id: str, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        data = await self._json(
            "GET",
            f"/v1/sessions/{_segment(session_id)}/files",
            params={"path": path, "recursive": recursive},
        )
        return [FileInfo.model_validate(f) for f in data]

    async def download(self, session_id: str, path: str) -> bytes:
        return _check(
            await self.http.get(f"/v1/sessions/{_segment(session_id)}/files/{_path(path)}")
        ).content

    async def delete_file(self, session_id: str, path: str) -> None:
        url = f"/v1/sessions/{_segment(session_id)}/files/{_path(path)}"
        _check(await self.http.delete(url))

    async def artifact(self, session_id: str, artifact_id: str) -> bytes:
        url = f"/v1/sessions/{_segment(session_id)}/artifacts/{artifact_id}"
        return _check(await self.http.get(url)).content

    # --- the tool
    async def tool_definition(self, format: str | None = None) -> dict[str, Any]:
        params = {"format": format} if format else {}
        result: dict[str, Any] = await self._json(
            "GET", "/v1/tools/code_interpreter", params=params
        )
        return result

    async def invoke_tool(
        self,
        arguments: Any,
        *,
        format: str = "openai_chat",
        call_id: str | None = None,
        inline_images: bool = True,
    ) -> dict[str, Any]:
        body = {
            "arguments": arguments,
            "format": format,
            "call_id": call_id,
            "inline_images": inline_images,
        }
        result: dict[str, Any] = await self._json(
            "POST", "/v1/tools/code_interpreter/invoke", json=body
        )
        return result

    # --- processes beside the kernel
    async def _ndjson(self, method: str, url: str, **kwargs: Any) -> AsyncGenerator[dict[str, Any]]:
        async with self.http.stream(method, url, timeout=_NO_READ_TIMEOUT, **kwargs) as response:
            if not response.is_success:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    async def run_command(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> CommandResult:
        """Run a command to its end: `request`, or its fields (`command="ls -l"` or
        `argv=[...]`, `env`, `cwd`, `timeout_s`, ...)."""
        data = await self._json(
            "POST",
            f"/v1/sessions/{_segment(session_id)}/commands",
            json=_process_body(request, fields),
            timeout=_NO_READ_TIMEOUT,
        )
        return CommandResult.model_validate(data)

    async def run_command_stream(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> AsyncGenerator[dict[str, Any]]:
        """Each NDJSON event: `start`, `stdout`/`stderr`/`pty` text, `keepalive`, `dropped`,
        and last `end` with the result. Closing the iterator early kills the command."""
        url = f"/v1/sessions/{_segment(session_id)}/commands/stream"
        async for event in self._ndjson("POST", url, json=_process_body(request, fields)):
            yield event

    async def start_process(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> ProcessInfo:
        """Start a process in the background (a server, a watcher, a terminal)."""
        data = await self._json(
            "POST",
            f"/v1/sessions/{_segment(session_id)}/processes",
            json=_process_body(request, fields),
        )
        return ProcessInfo.model_validate(data)

    async def list_processes(
        self, session_id: str, *, include_ended: bool = False
    ) -> list[ProcessInfo]:
        data = await self._json(
            "GET",
            f"/v1/sessions/{_segment(session_id)}/processes",
            params={"include_ended": include_ended},
        )
        return [ProcessInfo.model_validate(p) for p in data]

    async def process_info(self, session_id: str, pid: int) -> ProcessInfo:
        data = await self._json("GET", f"/v1/sessions/{_segment(session_id)}/processes/{pid}")
        return ProcessInfo.model_validate(data)

    async def process_output(
        self, session_id: str, pid: int, *, replay: bool = False
    ) -> AsyncGenerator[dict[str, Any]]:
        """A process's output from now on (`replay`: the most recent kept first) as NDJSON
        events, then `end`. Closing the iterator leaves the process running."""
        url = f"/v1/sessions/{_segment(session_id)}/processes/{pid}/output"
        async for event in self._ndjson("GET", url, params={"replay": replay}):
            yield event

    async def send_stdin(self, session_id: str, pid: int, data: bytes | str) -> None:
        body = data.encode() if isinstance(data, str) else data
        _check(
            await self.http.post(
                f"/v1/sessions/{_segment(session_id)}/processes/{pid}/stdin",
                content=body,
                headers={"Content-Type": "application/octet-stream"},
            )
        )

    async def close_stdin(self, session_id: str, pid: int) -> None:
        _check(
            await self.http.post(f"/v1/sessions/{_segment(session_id)}/processes/{pid}/stdin/close")
        )

    async def signal_process(self, session_id: str, pid: int, signal: str | int) -> None:
        """Send SIGTERM, SIGKILL, SIGINT, SIGHUP, SIGUSR1/2, SIGSTOP or SIGCONT (name or
        number) to a process and everything it started."""
        url = f"/v1/sessions/{_segment(session_id)}/processes/{pid}/signal"
        _check(await self.http.post(url, json={"signal": signal}))

    async def wait_process(self, session_id: str, pid: int) -> CommandResult:
        url = f"/v1/sessions/{_segment(session_id)}/processes/{pid}/wait"
        return CommandResult.model_validate(await self._json("POST", url, timeout=_NO_READ_TIMEOUT))

    async def resize_terminal(self, session_id: str, pid: int, cols: int, rows: int) -> None:
        size = TerminalSize(cols=cols, rows=rows)
        url = f"/v1/sessions/{_segment(session_id)}/processes/{pid}/resize"
        _check(await self.http.post(url, json=size.model_dump()))


def _process_body(request: ProcessRequest | None, fields: dict[str, Any]) -> dict[str, Any]:
    """The JSON of a process request, checked here first: a mistake is told before a call."""
    if request is not None and fields:
        raise TypeError("give a ProcessRequest or its fields, not both")
    checked = request if request is not None else ProcessRequest.model_validate(fields)
    return checked.model_dump(mode="json", exclude_unset=True)


def _iterate(events: AsyncGenerator[T]) -> Iterator[T]:
    """An async generator, iterated from blocking code; left early, it is closed (which ends
    its request: a streamed command is killed)."""
    try:
        while True:
            try:
                yield run_sync(anext(events))
            except StopAsyncIteration:
                return
    finally:
        run_sync(events.aclose())


class Client(BlockingVolumeCalls, BlockingSecretCalls):
    """The same calls, blocking. Each runs the async client on a background event loop."""

    api: AsyncClient

    def __init__(
        self, base_url: str, api_key: str | None = None, *, timeout_s: float = 600.0
    ) -> None:
        self.api = run_sync(_make(base_url, api_key, timeout_s))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        run_sync(self.api.close())

    def create_session(self, **body: Any) -> SessionInfo:
        return run_sync(self.api.create_session(**body))

    def get_session(self, session_id: str) -> SessionInfo:
        return run_sync(self.api.get_session(session_id))

    def list_sessions(self, state: SessionState | None = None) -> list[SessionInfo]:
        return run_sync(self.api.list_sessions(state))

    def pause(self, session_id: str) -> SessionInfo:
        return run_sync(self.api.pause(session_id))

    def resume(self, session_id: str) -> ResumeInfo:
        return run_sync(self.api.resume(session_id))

    def snapshot(self, session_id: str, name: str | None = None) -> SnapshotInfo:
        return run_sync(self.api.snapshot(session_id, name))

    def list_snapshots(self) -> list[SnapshotInfo]:
        return run_sync(self.api.list_snapshots())

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return run_sync(self.api.get_snapshot(snapshot_id))

    def delete_snapshot(self, snapshot_id: str) -> None:
        run_sync(self.api.delete_snapshot(snapshot_id))

    def delete_session(self, session_id: str) -> None:
        run_sync(self.api.delete_session(session_id))

    def network(self, session_id: str, limit: int = 100) -> NetworkReport:
        return run_sync(self.api.network(session_id, limit))

    def port_url(self, session_id: str, port: int, path: str = "/") -> str:
        return self.api.port_url(session_id, port, path)

    def port_request(
        self, session_id: str, port: int, method: str, path: str = "/", **kwargs: Any
    ) -> httpx.Response:
        return run_sync(self.api.port_request(session_id, port, method, path, **kwargs))

    def execute(self, session_id: str, code: str, **options: Any) -> ExecutionRecord:
        return run_sync(self.api.execute(session_id, code, **options))

    def execute_stream(
        self, session_id: str, code: str, **options: Any
    ) -> Iterator[dict[str, Any]]:
        events = self.api.execute_stream(session_id, code, **options)
        while True:
            try:
                yield run_sync(anext(events))  # type: ignore[arg-type]
            except StopAsyncIteration:
                return

    def interrupt(self, session_id: str) -> bool:
        return run_sync(self.api.interrupt(session_id))

    def restart(self, session_id: str, language: str | None = None) -> SessionInfo:
        return run_sync(self.api.restart(session_id, language))

    def languages(self) -> LanguagesResponse:
        return run_sync(self.api.languages())

    def upload(self, session_id: str, path: str, data: bytes) -> FileInfo:
        return run_sync(self.api.upload(session_id, path, data))

    def download(self, session_id: str, path: str) -> bytes:
        return run_sync(self.api.download(session_id, path))

    def list_files(self, session_id: str, path: str = "") -> list[FileInfo]:
        return run_sync(self.api.list_files(session_id, path))

    def invoke_tool(self, arguments: Any, **options: Any) -> dict[str, Any]:
        return run_sync(self.api.invoke_tool(arguments, **options))

    def run_command(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> CommandResult:
        return run_sync(self.api.run_command(session_id, request, **fields))

    def run_command_stream(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> Iterator[dict[str, Any]]:
        return _iterate(self.api.run_command_stream(session_id, request, **fields))

    def start_process(
        self, session_id: str, request: ProcessRequest | None = None, **fields: Any
    ) -> ProcessInfo:
        return run_sync(self.api.start_process(session_id, request, **fields))

    def list_processes(self, session_id: str, *, include_ended: bool = False) -> list[ProcessInfo]:
        return run_sync(self.api.list_processes(session_id, include_ended=include_ended))

    def process_info(self, session_id: str, pid: int) -> ProcessInfo:
        return run_sync(self.api.process_info(session_id, pid))

    def process_output(
        self, session_id: str, pid: int, *, replay: bool = False
    ) -> Iterator[dict[str, Any]]:
        return _iterate(self.api.process_output(session_id, pid, replay=replay))

    def send_stdin(self, session_id: str, pid: int, data: bytes | str) -> None:
        run_sync(self.api.send_stdin(session_id, pid, data))

    def close_stdin(self, session_id: str, pid: int) -> None:
        run_sync(self.api.close_stdin(session_id, pid))

    def signal_process(self, session_id: str, pid: int, signal: str | int) -> None:
        run_sync(self.api.signal_process(session_id, pid, signal))

    def wait_process(self, session_id: str, pid: int) -> CommandResult:
        return run_sync(self.api.wait_process(session_id, pid))

    def resize_terminal(self, session_id: str, pid: int, cols: int, rows: int) -> None:
        run_sync(self.api.resize_terminal(session_id, pid, cols, rows))


async def _make(base_url: str, api_key: str | None, timeout_s: float) -> AsyncClient:
    # Made on the background loop, so its connections belong to that loop.
    return AsyncClient(base_url, api_key, timeout_s=timeout_s)
