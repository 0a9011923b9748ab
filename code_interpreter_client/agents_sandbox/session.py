"""The Agents SDK's sandbox session on one code-interpreter session: commands, files, the
sandbox's life, workspace snapshots and the model's command sessions, each through the
`CodeSession` underneath."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.types import ExecResult, User
from agents.sandbox.workspace_paths import sandbox_path_str

from code_interpreter_client.agents_sandbox.archives import (
    FINGERPRINT_SCRIPT,
    FINGERPRINT_VERSION,
    NATIVE_SNAPSHOT_MAGIC,
    SNAPSHOT_FILE,
    TIMES_FILE,
    native_snapshot_ref,
    read_bytes,
    validate_tar,
    workspace_relative,
)
from code_interpreter_client.agents_sandbox.errors import TRANSPORT_ERRORS, ServiceOnly
from code_interpreter_client.agents_sandbox.options import (
    WORKSPACE,
    CodeInterpreterSandboxSessionState,
    refuse_user,
)
from code_interpreter_client.agents_sandbox.terminals import Terminal
from code_interpreter_client.code_session import CodeSession, RemoteSession
from code_interpreter_client.http_client import APIError, AsyncClient
from code_interpreter_wire.background_loop import run_in_background
from code_interpreter_wire.errors import FileMissing
from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessRequest,
    TerminalSize,
)


def shell_exit_code(result: CommandResult | ProcessEnd) -> int:
    """A shell's view of an end: the exit status, or 128 + the signal that ended it."""
    if result.exit_code is not None:
        return result.exit_code
    return 128 + result.signal if result.signal is not None else -1


class CodeInterpreterSandboxSession(BaseSandboxSession):
    """A sandbox session of the Agents SDK on one code-interpreter session."""

    state: CodeInterpreterSandboxSessionState

    def __init__(
        self,
        *,
        state: CodeInterpreterSandboxSessionState,
        code: CodeSession,
        on_shutdown: Callable[[CodeInterpreterSandboxSession], None] | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.state = state
        self._code = code
        self._on_shutdown = on_shutdown  # the client forgets a session that ended
        self._base_url = base_url  # the service (None: embedded), for its snapshots
        self._api_key = api_key
        self._live = True
        self._terminals: dict[int, Terminal] = {}
        self._terminals_lock = asyncio.Lock()

    @property
    def code_session(self) -> CodeSession:
        """The code-interpreter session underneath (the same sandbox: execute code in it too)."""
        return self._code

    # --- commands
    def _prepare_exec_command(
        self, *command: str | Path, shell: bool | list[str], user: str | User | None
    ) -> list[str]:
        refuse_user(user)
        return super()._prepare_exec_command(*command, shell=shell, user=None)

    async def _request(
        self, argv: list[str], timeout_s: float | None, terminal: bool = False
    ) -> ProcessRequest:
        env = await self.state.manifest.environment.resolve()
        return ProcessRequest(
            argv=argv,
            env=env,
            timeout_s=timeout_s or None,
            terminal=TerminalSize() if terminal else None,
            stdin=terminal,
        )

    async def _run(self, argv: list[str], timeout_s: float | None) -> CommandResult:
        """Run argv to its end in the sandbox; a caller that leaves kills it."""
        request = await self._request(argv, timeout_s)
        info = await self._code.start_process(request)
        try:
            return await self._code.wait_process(info.pid)
        except asyncio.CancelledError:
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await asyncio.shield(self._code.signal_process(info.pid, signal.SIGKILL))
            raise

    async def _exec_internal(
        self,
        *command: str | Path,
        timeout: float | None = None,  # noqa: ASYNC109 (the SDK's signature)
    ) -> ExecResult:
        argv = [str(part) for part in command]
        try:
            result = await self._run(argv, timeout)
        except TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=argv, cause=exc, message=str(exc)) from exc
        if result.timed_out:
            raise ExecTimeoutError(command=argv, timeout_s=timeout)
        return ExecResult(
            stdout=result.stdout.encode(),
            stderr=result.stderr.encode(),
            exit_code=shell_exit_code(result),
        )

    async def _checked(self, argv: list[str], what: str) -> CommandResult:
        """Run a command of this provider's own; a failure says what it was for and why."""
        try:
            result = await self._run(argv, None)
        except TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=[what], cause=exc, message=str(exc)) from exc
        if shell_exit_code(result) != 0:
            reason = (
                result.error or result.stderr.strip() or f"exit status {shell_exit_code(result)}"
            )
            raise ExecTransportError(command=[what], message=f"{what} failed: {reason}")
        return result

    # --- files
    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        refuse_user(user)
        target = await self._validate_path_access(path)
        relative = workspace_relative(target)
        try:
            if relative is None:
                return io.BytesIO(await self._read_with_command(target))
            return io.BytesIO(await self._code.download(relative))
        except FileMissing as exc:
            raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
        except APIError as exc:
            if exc.status == 404:
                raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc
        except TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc

    async def _read_with_command(self, target: Path) -> bytes:
        """A file outside the workspace, read as base64 by a command (within output limits)."""
        script = '[ -e "$1" ] || exit 44; exec base64 -w0 -- "$1"'
        result = await self._run(["sh", "-c", script, "sh", sandbox_path_str(target)], None)
        if result.exit_code == 44:
            raise FileMissing(f"{sandbox_path_str(target)} does not exist")
        if result.exit_code != 0 or result.stdout_dropped:
            reason = result.stderr.strip() or "it is larger than a command's output limit"
            raise WorkspaceArchiveReadError(path=target, context={"reason": reason})
        return base64.b64decode(result.stdout)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        refuse_user(user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode()
        target = await self._validate_path_access(path, for_write=True)
        relative = workspace_relative(target)
        try:
            if relative is None:
                await self._write_with_command(target, bytes(payload))
            else:
                await self._code.upload(relative, bytes(payload))
        except TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveWriteError(path=target, cause=exc) from exc

    async def _write_with_command(self, target: Path, payload: bytes) -> None:
        """A file outside the workspace: sent into the workspace, then copied there."""
        staged = SNAPSHOT_FILE.format(uuid.uuid4().hex)
        await self._code.upload(staged, payload)
        script = 'mkdir -p -- "$(dirname -- "$2")" && cp -- "$1" "$2"; s=$?; rm -f -- "$1"; exit $s'
        source = f"{WORKSPACE}/{staged}"
        await self._checked(
            ["sh", "-c", script, "sh", source, sandbox_path_str(target)], "writing the file"
        )

    # --- the sandbox's life
    async def running(self) -> bool:
        return self._live and self._code.session_id is not None

    async def _shutdown_backend(self) -> None:
        """The sandbox ends with the session (a snapshot, if any, was persisted before); with
        `pause_on_exit`, the service pauses the session instead, to be woken by a resume."""
        self._live = False
        try:
            code = self._code
            if (
                self.state.pause_on_exit
                and isinstance(code, RemoteSession)
                and code.session_id is not None
            ):
                with contextlib.suppress(*TRANSPORT_ERRORS):  # it could not pause: it ends
                    await code.pause()
                    code.disown()
            await self._code.close()
        finally:
            if self._on_shutdown is not None:
                self._on_shutdown(self)

    # --- the SDK's workspace fingerprint (see FINGERPRINT_VERSION)
    def _snapshot_fingerprint_version(self) -> str:
        return FINGERPRINT_VERSION

    async def _compute_and_cache_snapshot_fingerprint(
        self, *, version: str | None = None
    ) -> dict[str, str]:
        if version is not None and version != FINGERPRINT_VERSION:
            raise ValueError(f"no fingerprint of version {version!r} here: restore instead")
        cache = self._snapshot_fingerprint_cache_path().as_posix()
        skipped = [
            f"--exclude=./{p.as_posix()}"
            for p in sorted(self._workspace_fingerprint_skip_relpaths(), key=Path.as_posix)
        ]
        script = f"VERSION={FINGERPRINT_VERSION}\n{FINGERPRINT_SCRIPT}"
        argv = ["sh", "-c", script, "sh", WORKSPACE, cache, self._resume_manifest_digest()]
        result = await self._checked([*argv, *skipped], "fingerprinting the workspace")
        return self._parse_snapshot_fingerprint_record(result.stdout)

    # --- snapshots: a tar of the workspace, members relative to it, or a service snapshot
    async def persist_workspace(self) -> io.IOBase:
        skip = self._persist_workspace_skip_relpaths()
        if self.state.workspace_persistence == "snapshot" and not skip:
            return io.BytesIO(await self._persist_native())
        name = SNAPSHOT_FILE.format(uuid.uuid4().hex)
        times = TIMES_FILE.format(uuid.uuid4().hex)
        skipped = [f"--exclude=./{p.as_posix()}" for p in sorted(skip)]
        # The archive file exists before tar reads the directory, which then does not change
        # under it; tar's status 1 (a file changed while it was read) still made an archive.
        # The workspace's own times are kept aside first and put back once the archive is
        # gone: the SDK's fingerprint, taken just before, must still match the workspace.
        script = (
            'touch -r "$1" "$2" && cd "$1" && shift 2 && tar "$@" -cf - . > "$0"; s=$?;'
            " [ $s -le 1 ] || exit $s"
        )
        argv = [
            "sh",
            "-c",
            script,
            name,
            WORKSPACE,
            times,
            "--no-wildcards",  # a skipped path is a path, not a pattern
            f"--exclude=./{name}",
            *skipped,
        ]
        restore = 'rm -f -- "$1"; touch -r "$2" "$3"; s=$?; rm -f -- "$2"; exit $s'
        try:
            await self._checked(argv, "archiving the workspace")
            data = await self._code.download(name)
        except TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveReadError(path=Path(WORKSPACE), cause=exc) from exc
        finally:
            with contextlib.suppress(*TRANSPORT_ERRORS, ExecTransportError):
                await self._checked(
                    ["sh", "-c", restore, "sh", f"{WORKSPACE}/{name}", times, WORKSPACE],
                    "removing the tar",
                )
        return io.BytesIO(data)

    async def _persist_native(self) -> bytes:
        """A service snapshot of the session (variables and files), named after the SDK's
        snapshot id; older ones of that name are deleted, so a name holds one snapshot."""
        name = self.state.snapshot.id
        try:
            async with AsyncClient(self._service_url(), self._api_key) as api:
                session_id = self._code.session_id
                if session_id is None:
                    raise WorkspaceArchiveReadError(
                        path=Path(WORKSPACE), context={"reason": "the session is not running"}
                    )
                info = await api.snapshot(session_id, name)
                for older in await api.list_snapshots():
                    if older.name == name and older.id != info.id:
                        with contextlib.suppress(APIError):  # deleted meanwhile: fine
                            await api.delete_snapshot(older.id)
        except TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveReadError(path=Path(WORKSPACE), cause=exc) from exc
        return NATIVE_SNAPSHOT_MAGIC + json.dumps({"snapshot_id": info.id}).encode()

    def _service_url(self) -> str:
        if self._base_url is None:
            raise ServiceOnly('workspace_persistence="snapshot"')
        return self._base_url

    async def _restore_snapshot_into_workspace_on_resume(self) -> None:
        """A service snapshot replaces the whole session (nothing to clear first); a tar is
        checked before the live workspace is cleared for it."""
        archive = await self.state.snapshot.restore(dependencies=self.dependencies)
        try:
            raw = read_bytes(archive)
        finally:
            with contextlib.suppress(Exception):
                archive.close()
        if native_snapshot_ref(raw) is None:
            validate_tar(raw)
            await self._clear_workspace_root_on_resume()
        await self.hydrate_workspace(io.BytesIO(raw))

    async def _hydrate_native(self, snapshot_id: str) -> None:
        """Swap this session's sandbox for a new session started from the service snapshot:
        its files and its kernel's variables."""
        root = Path(WORKSPACE)
        if self._base_url is None:
            raise WorkspaceArchiveWriteError(
                path=root,
                context={"reason": "native_snapshot_needs_a_service", "snapshot_id": snapshot_id},
            )
        try:
            made = await run_in_background(
                create_remote_session(
                    self._base_url,
                    self._api_key,
                    self.state.backend,
                    self.state.network,
                    snapshot_id=snapshot_id,
                )
            )
            code = RemoteSession(self._base_url, self._api_key, made, owned=True)
            await code.start()
        except TRANSPORT_ERRORS as exc:
            context = {"reason": "native_snapshot_restore_failed", "snapshot_id": snapshot_id}
            raise WorkspaceArchiveWriteError(path=root, context=context, cause=exc) from exc
        await self.pty_terminate_all()
        old, self._code = self._code, code
        self.state.code_session_id = code.session_id
        with contextlib.suppress(*TRANSPORT_ERRORS):
            await old.close()

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        raw = read_bytes(data)
        snapshot_id = native_snapshot_ref(raw)
        if snapshot_id is not None:
            await self._hydrate_native(snapshot_id)
            return
        root = Path(WORKSPACE)
        validate_tar(raw)
        name = SNAPSHOT_FILE.format(uuid.uuid4().hex)
        # Unpacked by the sandbox's own tar, as its user: nothing lands outside the sandbox.
        script = 'tar -C "$1" --no-overwrite-dir -xf "$1/$2"; s=$?; rm -f -- "$1/$2"; exit $s'
        try:
            await self._code.upload(name, bytes(raw))
            await self._checked(["sh", "-c", script, "sh", WORKSPACE, name], "unpacking the tar")
        except (*TRANSPORT_ERRORS, ExecTransportError) as exc:
            raise WorkspaceArchiveWriteError(path=root, cause=exc) from exc

    # --- the model's command sessions (unified exec): background processes of the sandbox
    def supports_pty(self) -> bool:
        return True

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,  # noqa: ASYNC109 (the SDK's signature)
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        argv = self._prepare_exec_command(*command, shell=shell, user=user)
        try:
            request = await self._request(argv, timeout, terminal=tty)
            info = await self._code.start_process(request)
        except TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=argv, cause=exc, message=str(exc)) from exc
        terminal = Terminal(pid=info.pid, tty=tty)
        terminal.follower = asyncio.ensure_future(terminal.follow(self._code))
        async with self._terminals_lock:
            session_id = allocate_pty_process_id(set(self._terminals))
            pruned = self._prune_terminals()
            self._terminals[session_id] = terminal
        if pruned is not None:
            await self._end_terminal(pruned)
        wait_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(
            session_id, terminal, clamp_pty_yield_time_ms(wait_ms), max_output_tokens
        )

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        async with self._terminals_lock:
            terminal = self._resolve_pty_session_entry(
                pty_processes=self._terminals, session_id=session_id
            )
        if chars:
            if not terminal.tty:
                raise RuntimeError("stdin is not available for this process")
            with contextlib.suppress(*TRANSPORT_ERRORS):  # it may have just ended
                await self._code.send_input(terminal.pid, chars.encode())
        wait_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        wait_ms = resolve_pty_write_yield_time_ms(yield_time_ms=wait_ms, input_empty=chars == "")
        terminal.last_used = time.monotonic()
        return await self._collect(session_id, terminal, wait_ms, max_output_tokens)

    async def pty_terminate_all(self) -> None:
        async with self._terminals_lock:
            terminals = list(self._terminals.values())
            self._terminals.clear()
        for terminal in terminals:
            await self._end_terminal(terminal)

    async def _collect(
        self, session_id: int, terminal: Terminal, wait_ms: int, max_output_tokens: int | None
    ) -> PtyExecUpdate:
        output, original_tokens, ended = await collect_pty_output(
            output_chunks=terminal.chunks,
            output_lock=terminal.lock,
            output_notify=terminal.notify,
            is_done=terminal.ended.is_set,
            yield_time_ms=wait_ms,
            max_output_tokens=max_output_tokens,
        )
        async with terminal.lock:
            terminal.buffered = sum(len(chunk) for chunk in terminal.chunks)
        if not ended:
            return PtyExecUpdate(
                process_id=session_id,
                output=output,
                exit_code=None,
                original_token_count=original_tokens,
            )
        async with self._terminals_lock:
            self._terminals.pop(session_id, None)
        end = terminal.end or ProcessEnd(exit_code=None, error="the process was lost")
        return PtyExecUpdate(
            process_id=None,
            output=output,
            exit_code=shell_exit_code(end),
            original_token_count=original_tokens,
        )

    def _prune_terminals(self) -> Terminal | None:
        if len(self._terminals) < PTY_PROCESSES_MAX:
            return None
        meta = [(sid, t.last_used, t.ended.is_set()) for sid, t in self._terminals.items()]
        oldest = process_id_to_prune_from_meta(meta)
        return None if oldest is None else self._terminals.pop(oldest, None)

    async def _end_terminal(self, terminal: Terminal) -> None:
        if not terminal.ended.is_set():
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await self._code.signal_process(terminal.pid, signal.SIGKILL)
        if terminal.follower is not None:
            terminal.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await terminal.follower


async def create_remote_session(
    base_url: str,
    api_key: str | None,
    backend: str | None,
    network: NetworkPolicy | None,
    *,
    snapshot_id: str | None = None,
) -> str:
    """A new session of the service, on `backend` if named (else the service's default), with
    `network` if given (else the service's default policy), from `snapshot_id` if given."""
    async with AsyncClient(base_url, api_key) as api:
        body: dict[str, Any] = {"backend": backend} if backend is not None else {}
        if network is not None:
            body["network"] = network.model_dump(mode="json")
        if snapshot_id is not None:
            body["snapshot_id"] = snapshot_id
        return (await api.create_session(**body)).id
