"""The OpenAI Agents SDK's sandbox interface on our sessions: a `SandboxAgent` runs natively in
a code-interpreter sandbox, embedded in this process or through a running service.

    from agents import Runner, RunConfig
    from agents.run_config import SandboxRunConfig
    from code_interpreter_client.agents_sandbox import CodeInterpreterSandboxClient

    client = CodeInterpreterSandboxClient()  # embedded, on the local backend
    # or: CodeInterpreterSandboxClient(base_url="http://127.0.0.1:8000", api_key="...")
    config = RunConfig(sandbox=SandboxRunConfig(client=client))
    result = await Runner.run(agent, "...", run_config=config)

Every call goes through a `CodeSession` (embedded or remote), so it runs on the shared background
loop and through `Service`, like every other front door. Commands, the model's terminal sessions
(background processes), files and workspace snapshots all live inside the one sandbox of the
session: the same user, workspace, limits and no network as its kernel.

Files in the workspace move through the files API (binary-safe, no output caps); other paths
(only reachable with the manifest's extra path grants) go through commands. A snapshot is a tar of
the workspace with members relative to it, made and unpacked by `tar` inside the sandbox; or,
through a service with `workspace_persistence="snapshot"`, a reference to one of the service's
snapshots, which keeps the kernel's variables as well as the files.

Through a service, `pause_on_exit=True` pauses the session when the SDK shuts its sandbox down
(the Runner does at the end of a run) instead of ending it: the service keeps its variables and
files, and `resume()` wakes that same session, so a later run finds them as they were.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import httpx
from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSession, SandboxSessionState
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, User
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes
from agents.sandbox.workspace_paths import sandbox_path_str
from pydantic import ValidationError

from code_interpreter_client.code_session import CodeSession, RemoteSession
from code_interpreter_client.http_client import APIError, AsyncClient
from sandbox.background_loop import run_in_background
from sandbox.errors import FileMissing, SandboxError
from sandbox.network_policy import NetworkPolicy
from sandbox.processes.models import (
    CommandResult,
    ProcessEnd,
    ProcessOutput,
    ProcessRequest,
    TerminalSize,
)
from sandbox.spec import SandboxSpec

BACKEND_ID = "code_interpreter"
WORKSPACE = "/workspace"  # where every code-interpreter sandbox keeps its files
# A snapshot's tar while it is made or unpacked: in the workspace, where the files API reaches.
_SNAPSHOT_FILE = ".cir-agents-snapshot-{}.tar"
# Where the workspace's own times are kept while that tar comes and goes (outside the workspace).
_TIMES_FILE = "/tmp/.cir-agents-workspace-times-{}"
# What `persist_workspace` returns in "snapshot" mode: this line, then {"snapshot_id": ...}.
NATIVE_SNAPSHOT_MAGIC = b"CODE_INTERPRETER_SNAPSHOT_V1\n"
WorkspacePersistence = Literal["tar", "snapshot"]
# The SDK's fingerprint hashes a tar of the workspace, times and all. A paused session's files
# come back with new times (the service writes them afresh), so ours hashes what a workspace
# holds: paths, types, modes, link targets and contents, in name order, times and owners
# left out. A workspace the service brought back unchanged then needs no restore; one that
# lost something (a mode, a link) does not match, and is restored from the snapshot.
FINGERPRINT_VERSION = "code_interpreter_content_sha256_v1"
_FINGERPRINT_SCRIPT = r"""
root=$1; out=$2; digest=$3; st=$out.status.$$; shift 3
mkdir -p -- "$(dirname -- "$out")" || exit 1
h=$( { tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --no-wildcards "$@" \
  -C "$root" -cf - .; echo $? > "$st"; } | sha256sum | cut -d' ' -f1 )
s=$(cat "$st"); rm -f -- "$st"; [ "$s" -le 1 ] || exit "$s"
fp=$(printf '%s\n%s\n' "$h" "$digest" | sha256sum | cut -d' ' -f1)
payload=$(printf '{"fingerprint":"%s","version":"%s"}' "$fp" "$VERSION")
printf '%s' "$payload" > "$out.tmp.$$" && mv -f -- "$out.tmp.$$" "$out" && printf '%s' "$payload"
"""
# What one terminal session keeps for the model between its polls; older output is dropped.
TERMINAL_BUFFER_BYTES = 1 << 20
_TERMINAL_DROPPED = b"\n[... earlier output dropped: it was not read in time ...]\n"
# Failures of the way to the sandbox (not of the command run in it).
_TRANSPORT_ERRORS = (SandboxError, APIError, httpx.HTTPError, ValidationError)


class CodeInterpreterSandboxClientOptions(BaseSandboxClientOptions):
    """Per-session choices. `backend`: which backend the sandbox runs on (embedded: `local`
    unless named; through a service: the service's default unless named). `network`: what its
    code may reach ('none', 'any', a list of allowed hosts such as `["pypi.org",
    "*.pythonhosted.org"]`; docs/network.md); the service's default (or, embedded, the spec's)
    unless given.

    Through a service only (embedded sessions end with this process, so both are refused
    there): `pause_on_exit` pauses the service session when the sandbox shuts down instead of
    ending it, and a resume wakes it with its variables and files. `workspace_persistence`:
    "tar" (a tar of the workspace, for any snapshot store) or "snapshot" (a snapshot of the
    service, named after the SDK's snapshot id, that keeps variables too; the SDK's store
    holds only a reference to it, and a tar is made instead when the SDK asks for paths to be
    left out)."""

    type: Literal["code_interpreter"] = "code_interpreter"
    backend: str | None = None
    network: NetworkPolicy | None = None
    pause_on_exit: bool = False
    workspace_persistence: WorkspacePersistence = "tar"


class CodeInterpreterSandboxSessionState(SandboxSessionState):
    """What resumes a session: the service session it runs in, found again by id if alive
    (woken if paused)."""

    type: Literal["code_interpreter"] = "code_interpreter"
    backend: str | None = None
    network: NetworkPolicy | None = None
    code_session_id: str | None = None
    pause_on_exit: bool = False
    workspace_persistence: WorkspacePersistence = "tar"


class _ServiceOnly(ValueError):
    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs a running service (base_url=...): an embedded session lives and "
            "ends with this process, so there is nothing to pause or snapshot for a later one"
        )


def _check_service_options(
    embedded: bool, pause_on_exit: bool, persistence: WorkspacePersistence
) -> None:
    if embedded and pause_on_exit:
        raise _ServiceOnly("pause_on_exit=True")
    if embedded and persistence == "snapshot":
        raise _ServiceOnly('workspace_persistence="snapshot"')


def native_snapshot_ref(data: bytes) -> str | None:
    """The service snapshot id a "snapshot"-mode archive names, or None for a tar."""
    if not data.startswith(NATIVE_SNAPSHOT_MAGIC):
        return None
    try:
        ref = json.loads(data[len(NATIVE_SNAPSHOT_MAGIC) :])
    except ValueError:
        return None
    snapshot_id = ref.get("snapshot_id") if isinstance(ref, dict) else None
    return snapshot_id if isinstance(snapshot_id, str) and snapshot_id else None


class _SingleUser(ValueError):
    def __init__(self) -> None:
        super().__init__(
            "a code-interpreter sandbox runs everything as its one unprivileged user (it has no "
            "other users and no root); run without `user` / `run_as`"
        )


def _refuse_user(user: str | User | None) -> None:
    if user is not None:
        raise _SingleUser()


def _exit_code(result: CommandResult | ProcessEnd) -> int:
    """A shell's view of an end: the exit status, or 128 + the signal that ended it."""
    if result.exit_code is not None:
        return result.exit_code
    return 128 + result.signal if result.signal is not None else -1


def _read_bytes(data: io.IOBase) -> bytes:
    raw = data.read()
    return raw.encode() if isinstance(raw, str) else bytes(raw)


def _validate_tar(raw: bytes) -> None:
    """Refuse an archive with a member that would land outside the workspace (`..`, an
    absolute path, a link out of it), before anything of the workspace is touched."""
    try:
        validate_tar_bytes(raw, allow_external_symlink_targets=False)
    except UnsafeTarMemberError as exc:
        context = {"reason": exc.reason, "member": exc.member}
        raise WorkspaceArchiveWriteError(path=Path(WORKSPACE), context=context, cause=exc) from exc


def _workspace_relative(path: Path) -> str | None:
    """The path inside the workspace ("" for its root), or None when it is elsewhere."""
    posix = PurePosixPath(sandbox_path_str(path))
    try:
        relative = posix.relative_to(WORKSPACE).as_posix()
    except ValueError:
        return None
    return "" if relative == "." else relative


@dataclass
class _Terminal:
    """One of the model's running command sessions: a background process of the sandbox, its
    output gathered here (bounded) until the model polls for it."""

    pid: int
    tty: bool
    chunks: deque[bytes] = field(default_factory=deque)
    buffered: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end: ProcessEnd | None = None
    follower: asyncio.Task[None] | None = None
    last_used: float = field(default_factory=time.monotonic)

    async def add(self, data: bytes) -> None:
        async with self.lock:
            self.chunks.append(data)
            self.buffered += len(data)
            # Drop the oldest output, leaving one marker in its place.
            while self.buffered > TERMINAL_BUFFER_BYTES and len(self.chunks) > 2:
                if self.chunks[0] is _TERMINAL_DROPPED:
                    self.buffered -= len(self.chunks.popleft())
                self.buffered -= len(self.chunks.popleft())
                self.chunks.appendleft(_TERMINAL_DROPPED)
                self.buffered += len(_TERMINAL_DROPPED)
        self.notify.set()

    async def follow(self, code: CodeSession) -> None:
        try:
            async for event in code.process_events(self.pid, replay=True):
                if isinstance(event, ProcessOutput):
                    await self.add(event.data)
                else:
                    self.end = event
        except _TRANSPORT_ERRORS as exc:  # the session went away: the process with it
            self.end = ProcessEnd(exit_code=None, error=f"lost the process: {exc}")
        finally:
            self.ended.set()
            self.notify.set()


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
        self._terminals: dict[int, _Terminal] = {}
        self._terminals_lock = asyncio.Lock()

    @property
    def code_session(self) -> CodeSession:
        """The code-interpreter session underneath (the same sandbox: execute code in it too)."""
        return self._code

    # --- commands
    def _prepare_exec_command(
        self, *command: str | Path, shell: bool | list[str], user: str | User | None
    ) -> list[str]:
        _refuse_user(user)
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
            with contextlib.suppress(*_TRANSPORT_ERRORS):
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
        except _TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=argv, cause=exc, message=str(exc)) from exc
        if result.timed_out:
            raise ExecTimeoutError(command=argv, timeout_s=timeout)
        return ExecResult(
            stdout=result.stdout.encode(),
            stderr=result.stderr.encode(),
            exit_code=_exit_code(result),
        )

    async def _checked(self, argv: list[str], what: str) -> CommandResult:
        """Run a command of this provider's own; a failure says what it was for and why."""
        try:
            result = await self._run(argv, None)
        except _TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=[what], cause=exc, message=str(exc)) from exc
        if _exit_code(result) != 0:
            reason = result.error or result.stderr.strip() or f"exit status {_exit_code(result)}"
            raise ExecTransportError(command=[what], message=f"{what} failed: {reason}")
        return result

    # --- files
    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        _refuse_user(user)
        target = await self._validate_path_access(path)
        relative = _workspace_relative(target)
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
        except _TRANSPORT_ERRORS as exc:
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
        _refuse_user(user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode()
        target = await self._validate_path_access(path, for_write=True)
        relative = _workspace_relative(target)
        try:
            if relative is None:
                await self._write_with_command(target, bytes(payload))
            else:
                await self._code.upload(relative, bytes(payload))
        except _TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveWriteError(path=target, cause=exc) from exc

    async def _write_with_command(self, target: Path, payload: bytes) -> None:
        """A file outside the workspace: sent into the workspace, then copied there."""
        staged = _SNAPSHOT_FILE.format(uuid.uuid4().hex)
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
                with contextlib.suppress(*_TRANSPORT_ERRORS):  # it could not pause: it ends
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
        script = f"VERSION={FINGERPRINT_VERSION}\n{_FINGERPRINT_SCRIPT}"
        argv = ["sh", "-c", script, "sh", WORKSPACE, cache, self._resume_manifest_digest()]
        result = await self._checked([*argv, *skipped], "fingerprinting the workspace")
        return self._parse_snapshot_fingerprint_record(result.stdout)

    # --- snapshots: a tar of the workspace, members relative to it, or a service snapshot
    async def persist_workspace(self) -> io.IOBase:
        skip = self._persist_workspace_skip_relpaths()
        if self.state.workspace_persistence == "snapshot" and not skip:
            return io.BytesIO(await self._persist_native())
        name = _SNAPSHOT_FILE.format(uuid.uuid4().hex)
        times = _TIMES_FILE.format(uuid.uuid4().hex)
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
        except _TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveReadError(path=Path(WORKSPACE), cause=exc) from exc
        finally:
            with contextlib.suppress(*_TRANSPORT_ERRORS, ExecTransportError):
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
        except _TRANSPORT_ERRORS as exc:
            raise WorkspaceArchiveReadError(path=Path(WORKSPACE), cause=exc) from exc
        return NATIVE_SNAPSHOT_MAGIC + json.dumps({"snapshot_id": info.id}).encode()

    def _service_url(self) -> str:
        if self._base_url is None:
            raise _ServiceOnly('workspace_persistence="snapshot"')
        return self._base_url

    async def _restore_snapshot_into_workspace_on_resume(self) -> None:
        """A service snapshot replaces the whole session (nothing to clear first); a tar is
        checked before the live workspace is cleared for it."""
        archive = await self.state.snapshot.restore(dependencies=self.dependencies)
        try:
            raw = _read_bytes(archive)
        finally:
            with contextlib.suppress(Exception):
                archive.close()
        if native_snapshot_ref(raw) is None:
            _validate_tar(raw)
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
                _create_remote_session(
                    self._base_url,
                    self._api_key,
                    self.state.backend,
                    self.state.network,
                    snapshot_id=snapshot_id,
                )
            )
            code = RemoteSession(self._base_url, self._api_key, made, owned=True)
            await code.start()
        except _TRANSPORT_ERRORS as exc:
            context = {"reason": "native_snapshot_restore_failed", "snapshot_id": snapshot_id}
            raise WorkspaceArchiveWriteError(path=root, context=context, cause=exc) from exc
        await self.pty_terminate_all()
        old, self._code = self._code, code
        self.state.code_session_id = code.session_id
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            await old.close()

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        raw = _read_bytes(data)
        snapshot_id = native_snapshot_ref(raw)
        if snapshot_id is not None:
            await self._hydrate_native(snapshot_id)
            return
        root = Path(WORKSPACE)
        _validate_tar(raw)
        name = _SNAPSHOT_FILE.format(uuid.uuid4().hex)
        # Unpacked by the sandbox's own tar, as its user: nothing lands outside the sandbox.
        script = 'tar -C "$1" --no-overwrite-dir -xf "$1/$2"; s=$?; rm -f -- "$1/$2"; exit $s'
        try:
            await self._code.upload(name, bytes(raw))
            await self._checked(["sh", "-c", script, "sh", WORKSPACE, name], "unpacking the tar")
        except (*_TRANSPORT_ERRORS, ExecTransportError) as exc:
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
        except _TRANSPORT_ERRORS as exc:
            raise ExecTransportError(command=argv, cause=exc, message=str(exc)) from exc
        terminal = _Terminal(pid=info.pid, tty=tty)
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
            with contextlib.suppress(*_TRANSPORT_ERRORS):  # it may have just ended
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
        self, session_id: int, terminal: _Terminal, wait_ms: int, max_output_tokens: int | None
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
            exit_code=_exit_code(end),
            original_token_count=original_tokens,
        )

    def _prune_terminals(self) -> _Terminal | None:
        if len(self._terminals) < PTY_PROCESSES_MAX:
            return None
        meta = [(sid, t.last_used, t.ended.is_set()) for sid, t in self._terminals.items()]
        oldest = process_id_to_prune_from_meta(meta)
        return None if oldest is None else self._terminals.pop(oldest, None)

    async def _end_terminal(self, terminal: _Terminal) -> None:
        if not terminal.ended.is_set():
            with contextlib.suppress(*_TRANSPORT_ERRORS):
                await self._code.signal_process(terminal.pid, signal.SIGKILL)
        if terminal.follower is not None:
            terminal.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await terminal.follower


class CodeInterpreterSandboxClient(BaseSandboxClient[CodeInterpreterSandboxClientOptions | None]):
    """Makes Agents SDK sandbox sessions on code-interpreter sessions.

    `base_url` (and `api_key`): a running service; without it, each sandbox is an embedded
    session of this process (`CodeSession.embedded`, with `spec` and `backend_config`; needs the
    server extra). Close the client (`await client.close()`) to end embedded sessions that a run
    left alive for resuming.
    """

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        spec: SandboxSpec | None = None,
        backend_config: Mapping[str, Any] | None = None,
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        self.base_url = base_url
        self._api_key = api_key  # kept here, never in a session's (serializable) state
        self._spec = spec
        self._backend_config = dict(backend_config or {})
        self._instrumentation = instrumentation or Instrumentation()
        self._dependencies = dependencies
        self._live: dict[str, CodeInterpreterSandboxSession] = {}  # by code session id

    async def _new_code_session(
        self, backend: str | None, network: NetworkPolicy | None = None
    ) -> CodeSession:
        if self.base_url is not None:
            made = await run_in_background(
                _create_remote_session(self.base_url, self._api_key, backend, network)
            )
            code: CodeSession = RemoteSession(self.base_url, self._api_key, made, owned=True)
        else:
            spec = self._spec
            if network is not None:
                spec = (spec or SandboxSpec()).model_copy(update={"network": network})
            code = CodeSession.embedded(backend or "local", spec, **self._backend_config)
        try:
            await code.start()
        except BaseException:
            await code.close()
            raise
        return code

    def _session(
        self, state: CodeInterpreterSandboxSessionState, code: CodeSession, *, preserved: bool
    ) -> SandboxSession:
        inner = CodeInterpreterSandboxSession(
            state=state,
            code=code,
            on_shutdown=self._forget,
            base_url=self.base_url,
            api_key=self._api_key,
        )
        inner._set_start_state_preserved(preserved, system=preserved)
        assert code.session_id is not None
        self._live[code.session_id] = inner
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def _forget(self, session: CodeInterpreterSandboxSession) -> None:
        for key, live in list(self._live.items()):
            if live is session:
                del self._live[key]

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: CodeInterpreterSandboxClientOptions | None = None,
    ) -> SandboxSession:
        options = options or CodeInterpreterSandboxClientOptions()
        manifest = self._validate_manifest_for_create(manifest or Manifest())
        _check_root(manifest)
        _check_service_options(
            self.base_url is None, options.pause_on_exit, options.workspace_persistence
        )
        code = await self._new_code_session(options.backend, options.network)
        session_id = uuid.uuid4()
        state = CodeInterpreterSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            backend=options.backend,
            network=options.network,
            code_session_id=code.session_id,
            pause_on_exit=options.pause_on_exit,
            workspace_persistence=options.workspace_persistence,
            workspace_root_ready=True,  # /workspace exists in every sandbox
        )
        return self._session(state, code, preserved=False)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, CodeInterpreterSandboxSession):
            raise TypeError("CodeInterpreterSandboxClient.delete expects one of its own sessions")
        if await inner.running():
            await inner.shutdown()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """The session the state names, if this client (embedded) or the service (remote)
        still has it, woken if it was paused: its workspace and variables are as they were.
        Else a new one, which the SDK then hydrates from the state's snapshot."""
        if not isinstance(state, CodeInterpreterSandboxSessionState):
            raise TypeError("CodeInterpreterSandboxClient.resume expects its own session state")
        state.assert_path_grants_rebound()
        _check_root(state.manifest)
        _check_service_options(
            self.base_url is None, state.pause_on_exit, state.workspace_persistence
        )
        code = await self._reattach(state.code_session_id)
        if code is not None:
            return self._session(state, code, preserved=True)
        code = await self._new_code_session(state.backend, state.network)
        state.code_session_id = code.session_id
        state.workspace_root_ready = False  # a new sandbox: nothing of the old one is in it
        return self._session(state, code, preserved=False)

    async def _reattach(self, code_session_id: str | None) -> CodeSession | None:
        if code_session_id is None:
            return None
        if self.base_url is None:
            live = self._live.pop(code_session_id, None)
            return live.code_session if live is not None and await live.running() else None
        code = RemoteSession(self.base_url, self._api_key, code_session_id, owned=True)
        try:
            await code.start()
            if (await code.state()).state == "paused":
                await code.resume()  # now, so the SDK's first look finds it running
        except BaseException as exc:
            # Not reattached: the session is left to the service as it is (a paused one whose
            # resume failed keeps its saved state, to be tried again), never ended from here.
            code.disown()
            with contextlib.suppress(Exception):
                await code.close()
            if isinstance(exc, APIError) and exc.status in (404, 410):
                return None
            raise
        return code

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, CodeInterpreterSandboxSessionState)

    async def close(self) -> None:
        """End every session this client still holds (those a run left alive for resuming)."""
        sessions, self._live = list(self._live.values()), {}
        for session in sessions:
            with contextlib.suppress(Exception):
                await session.shutdown()


async def _create_remote_session(
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


def _check_root(manifest: Manifest) -> None:
    if manifest.root != WORKSPACE:
        raise ValueError(
            f"the workspace of a code-interpreter sandbox is {WORKSPACE}; the manifest's root "
            f"is {manifest.root!r}: leave `root` at its default"
        )
