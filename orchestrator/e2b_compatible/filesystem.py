"""E2B's filesystem service (envd's Connect RPC `filesystem.Filesystem`) over the workspace.

Served by the SDK's own generated Connect application, so the protocol (Connect, JSON or binary)
is exactly what the SDK speaks: `ListDir`, `Stat`, `Remove` and `MakeDir` work; `Move` and the
watchers answer UNIMPLEMENTED. The process service (`commands`, `pty`) is mounted only to
answer UNIMPLEMENTED with a reason: sandboxes here run code in a kernel, not shell commands.
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable
from datetime import datetime
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.e2b_compatible.paths import to_sandbox, to_workspace
from orchestrator.e2b_compatible.sandboxes import E2BSandboxes, SandboxGone
from orchestrator.sessions import Session
from sandbox.errors import (
    FileAccessError,
    FileMissing,
    InvalidPath,
    SandboxClosed,
    SandboxError,
)
from sandbox.models import FileInfo

T = TypeVar("T")
_TYPES = {
    "file": filesystem_pb.FileType.FILE,
    "directory": filesystem_pb.FileType.DIRECTORY,
    "symlink": filesystem_pb.FileType.SYMLINK,
}


class WorkspaceFilesystem(filesystem_connect.Filesystem):
    """The Filesystem service; methods not defined here answer UNIMPLEMENTED."""

    def __init__(self, sandboxes: E2BSandboxes) -> None:
        self.sandboxes = sandboxes
        self.service = sandboxes.service

    async def _session(self, ctx: RequestContext[Any, Any]) -> Session:
        headers = ctx.request_headers
        sandbox_id = headers.get("e2b-sandbox-id") or ""
        token = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
        try:
            _, session = await self.sandboxes.reachable(sandbox_id, token)
        except SandboxGone as exc:
            raise ConnectError(Code.UNAVAILABLE, str(exc)) from None
        return session

    async def stat(
        self,
        request: filesystem_pb.StatRequest,
        ctx: RequestContext[filesystem_pb.StatRequest, filesystem_pb.StatResponse],
        /,
    ) -> filesystem_pb.StatResponse:
        session = await self._session(ctx)
        entry = await _call(self._stat(session, _relative(request.path)))
        return filesystem_pb.StatResponse(entry=entry)

    async def list_dir(
        self,
        request: filesystem_pb.ListDirRequest,
        ctx: RequestContext[filesystem_pb.ListDirRequest, filesystem_pb.ListDirResponse],
        /,
    ) -> filesystem_pb.ListDirResponse:
        session = await self._session(ctx)
        relative = _relative(request.path)
        depth = max(1, request.depth)
        found = await _call(self.service.list_files(session, relative, recursive=depth > 1))
        base = len(relative.split("/")) if relative else 0
        entries = [_entry(info) for info in found if len(info.path.split("/")) - base <= depth]
        return filesystem_pb.ListDirResponse(entries=entries)

    async def remove(
        self,
        request: filesystem_pb.RemoveRequest,
        ctx: RequestContext[filesystem_pb.RemoveRequest, filesystem_pb.RemoveResponse],
        /,
    ) -> filesystem_pb.RemoveResponse:
        session = await self._session(ctx)
        relative = _relative(request.path)
        if not relative:
            raise ConnectError(Code.INVALID_ARGUMENT, "the workspace itself cannot be removed")
        await _call(self.service.remove_file(session, relative))
        return filesystem_pb.RemoveResponse()

    async def make_dir(
        self,
        request: filesystem_pb.MakeDirRequest,
        ctx: RequestContext[filesystem_pb.MakeDirRequest, filesystem_pb.MakeDirResponse],
        /,
    ) -> filesystem_pb.MakeDirResponse:
        session = await self._session(ctx)
        relative = _relative(request.path)
        try:
            await _call(self._stat(session, relative))
        except ConnectError as exc:
            if exc.code != Code.NOT_FOUND:
                raise
        else:
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        await _call(self.service.make_directory(session, relative))
        return filesystem_pb.MakeDirResponse(entry=await _call(self._stat(session, relative)))

    async def _stat(self, session: Session, relative: str) -> filesystem_pb.EntryInfo:
        if not relative:
            return filesystem_pb.EntryInfo(
                name=posixpath.basename(to_sandbox("")),
                type=filesystem_pb.FileType.DIRECTORY,
                path=to_sandbox(""),
            )
        info = await self.service.file_info(session, relative)
        if info is None:
            raise FileMissing(f"no such file or directory: {to_sandbox(relative)}")
        return _entry(info)


class NoProcesses(process_connect.Process):
    """The process service: every call answers UNIMPLEMENTED (see the module's docstring)."""


def _relative(path: str) -> str:
    try:
        return to_workspace(path)
    except InvalidPath as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None


def _entry(info: FileInfo) -> filesystem_pb.EntryInfo:
    return filesystem_pb.EntryInfo(
        name=posixpath.basename(info.path),
        type=_TYPES.get(info.type, filesystem_pb.FileType.UNSPECIFIED),
        path=to_sandbox(info.path),
        size=info.size,
        modified_time=Timestamp.from_datetime(_aware(info.modified_at)),
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.astimezone()


async def _call(work: Awaitable[T]) -> T:
    """Await sandbox work, answering our typed errors with Connect's codes."""
    try:
        return await work
    except FileMissing as exc:
        raise ConnectError(Code.NOT_FOUND, str(exc)) from None
    except (InvalidPath, FileAccessError) as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None
    except SandboxClosed as exc:
        raise ConnectError(Code.UNAVAILABLE, f"The sandbox was not found: {exc}") from None
    except SandboxError as exc:
        raise ConnectError(Code.INTERNAL, str(exc)) from None


class StripPrefix:
    """Serves an ASGI app below a path prefix as if it were at the root (a Connect app matches
    its full method paths, `/filesystem.Filesystem/ListDir`, whatever it is mounted under)."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix + "/"):
            scope = {**scope, "path": scope["path"][len(self.prefix) :], "root_path": ""}
        await self.app(scope, receive, send)
