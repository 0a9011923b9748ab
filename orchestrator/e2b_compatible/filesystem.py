"""E2B's filesystem service (envd's Connect RPC `filesystem.Filesystem`) over the workspace.

Served by the SDK's own generated Connect application, so the protocol (Connect, JSON or binary)
is exactly what the SDK speaks. Paths in the workspace (`/workspace`, E2B's home `/home/user`,
relative ones) go through the files API; other paths of the sandbox (`/tmp`) through small
commands run inside it (sandbox_files.py), as root when the call's user is (E2B's
`user="root"`, where the sandbox has one). `Move` is a command (the sandbox interface has no
rename); the watchers compare listings of the workspace (watchers.py).
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.types import ASGIApp, Receive, Scope, Send

from code_interpreter_wire.errors import FileMissing
from code_interpreter_wire.results import FileInfo
from orchestrator.e2b_compatible import sandbox_files
from orchestrator.e2b_compatible.connect_calls import call, connect_errors, session_for
from orchestrator.e2b_compatible.paths import in_sandbox, in_workspace, to_sandbox, to_workspace
from orchestrator.e2b_compatible.processes import check_user
from orchestrator.e2b_compatible.sandboxes import E2BSandboxes
from orchestrator.e2b_compatible.watchers import POLL_S, Watchers, changes, listing
from orchestrator.sessions import Session

_TYPES = {
    "file": filesystem_pb.FileType.FILE,
    "directory": filesystem_pb.FileType.DIRECTORY,
    "symlink": filesystem_pb.FileType.SYMLINK,
}
WATCH_KEEPALIVE_S = 30.0


class WorkspaceFilesystem(filesystem_connect.Filesystem):
    """The Filesystem service, one for the front; each call finds its sandbox by its headers."""

    def __init__(self, sandboxes: E2BSandboxes) -> None:
        self.sandboxes = sandboxes
        self.service = sandboxes.service
        self.watchers = Watchers()

    async def _session(self, ctx: RequestContext[Any, Any]) -> Session:
        return await session_for(self.sandboxes, ctx)

    async def stat(
        self,
        request: filesystem_pb.StatRequest,
        ctx: RequestContext[filesystem_pb.StatRequest, filesystem_pb.StatResponse],
        /,
    ) -> filesystem_pb.StatResponse:
        session = await self._session(ctx)
        return filesystem_pb.StatResponse(entry=await self._stat(session, request.path, _user(ctx)))

    async def list_dir(
        self,
        request: filesystem_pb.ListDirRequest,
        ctx: RequestContext[filesystem_pb.ListDirRequest, filesystem_pb.ListDirResponse],
        /,
    ) -> filesystem_pb.ListDirResponse:
        session = await self._session(ctx)
        depth = max(1, request.depth)
        if not in_workspace(request.path):
            path = in_sandbox(request.path)
            found = await call(
                sandbox_files.list_dir(self.service, session, path, depth, _user(ctx))
            )
            return filesystem_pb.ListDirResponse(entries=[_sandbox_entry(e) for e in found])
        relative = _relative(request.path)
        if relative:
            await self._stat(session, request.path)  # missing: NOT_FOUND, never an empty list
        listed = await call(self.service.files.list_files(session, relative, recursive=depth > 1))
        base = len(relative.split("/")) if relative else 0
        entries = [_entry(info) for info in listed if len(info.path.split("/")) - base <= depth]
        return filesystem_pb.ListDirResponse(entries=entries)

    async def remove(
        self,
        request: filesystem_pb.RemoveRequest,
        ctx: RequestContext[filesystem_pb.RemoveRequest, filesystem_pb.RemoveResponse],
        /,
    ) -> filesystem_pb.RemoveResponse:
        session = await self._session(ctx)
        if not in_workspace(request.path):
            path = in_sandbox(request.path)
            await call(sandbox_files.remove(self.service, session, path, _user(ctx)))
            return filesystem_pb.RemoveResponse()
        relative = _relative(request.path)
        if not relative:
            raise ConnectError(Code.INVALID_ARGUMENT, "the workspace itself cannot be removed")
        await call(self.service.files.remove_file(session, relative))
        return filesystem_pb.RemoveResponse()

    async def make_dir(
        self,
        request: filesystem_pb.MakeDirRequest,
        ctx: RequestContext[filesystem_pb.MakeDirRequest, filesystem_pb.MakeDirResponse],
        /,
    ) -> filesystem_pb.MakeDirResponse:
        session = await self._session(ctx)
        user = _user(ctx)
        try:
            await self._stat(session, request.path, user)
        except ConnectError as exc:
            if exc.code != Code.NOT_FOUND:
                raise
        else:
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        if in_workspace(request.path):
            await call(self.service.files.make_directory(session, _relative(request.path)))
        else:
            path = in_sandbox(request.path)
            await call(sandbox_files.make_dir(self.service, session, path, user))
        return filesystem_pb.MakeDirResponse(entry=await self._stat(session, request.path, user))

    async def move(
        self,
        request: filesystem_pb.MoveRequest,
        ctx: RequestContext[filesystem_pb.MoveRequest, filesystem_pb.MoveResponse],
        /,
    ) -> filesystem_pb.MoveResponse:
        """A rename by `mv` in the sandbox (its parents made, as envd does)."""
        session = await self._session(ctx)
        user = _user(ctx)
        for path in (request.source, request.destination):
            if in_workspace(path) and not _relative(path):
                raise ConnectError(Code.INVALID_ARGUMENT, "the workspace itself cannot be moved")
        source, destination = in_sandbox(request.source), in_sandbox(request.destination)
        try:
            await call(sandbox_files.move(self.service, session, source, destination, user))
        except ConnectError as exc:
            if exc.code == Code.NOT_FOUND:
                raise ConnectError(
                    Code.NOT_FOUND, f"source file not found: {exc.message}"
                ) from None
            raise
        return filesystem_pb.MoveResponse(
            entry=await self._stat(session, request.destination, user)
        )

    async def _stat(
        self, session: Session, path: str, user: sandbox_files.User = None
    ) -> filesystem_pb.EntryInfo:
        if not in_workspace(path):
            found = await call(sandbox_files.stat(self.service, session, in_sandbox(path), user))
            return _sandbox_entry(found)
        relative = _relative(path)
        if not relative:
            return filesystem_pb.EntryInfo(
                name=posixpath.basename(to_sandbox("")),
                type=filesystem_pb.FileType.DIRECTORY,
                path=to_sandbox(""),
            )
        with connect_errors():
            info = await self.service.files.file_info(session, relative)
            if info is None:
                raise FileMissing(f"no such file or directory: {to_sandbox(relative)}")
        return _entry(info)

    # --- watchers
    def _watched(self, path: str) -> str:
        if not in_workspace(path):
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"{path} cannot be watched: watching works for the workspace (/workspace, which "
                "/home/user names) only; watch a directory under it",
            )
        return _relative(path)

    async def create_watcher(
        self,
        request: filesystem_pb.CreateWatcherRequest,
        ctx: RequestContext[
            filesystem_pb.CreateWatcherRequest, filesystem_pb.CreateWatcherResponse
        ],
        /,
    ) -> filesystem_pb.CreateWatcherResponse:
        session = await self._session(ctx)
        relative = self._watched(request.path)
        watcher_id = await call(
            self.watchers.create(self.service, session, relative, request.recursive)
        )
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self,
        request: filesystem_pb.GetWatcherEventsRequest,
        ctx: RequestContext[
            filesystem_pb.GetWatcherEventsRequest, filesystem_pb.GetWatcherEventsResponse
        ],
        /,
    ) -> filesystem_pb.GetWatcherEventsResponse:
        session = await self._session(ctx)
        found = await call(self.watchers.events(self.service, session, request.watcher_id))
        events = [filesystem_pb.FilesystemEvent(name=name, type=kind) for name, kind in found]
        return filesystem_pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self,
        request: filesystem_pb.RemoveWatcherRequest,
        ctx: RequestContext[
            filesystem_pb.RemoveWatcherRequest, filesystem_pb.RemoveWatcherResponse
        ],
        /,
    ) -> filesystem_pb.RemoveWatcherResponse:
        session = await self._session(ctx)
        with connect_errors():
            self.watchers.remove(session, request.watcher_id)
        return filesystem_pb.RemoveWatcherResponse()

    def watch_dir(
        self,
        request: filesystem_pb.WatchDirRequest,
        ctx: RequestContext[filesystem_pb.WatchDirRequest, filesystem_pb.WatchDirResponse],
        /,
    ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        return self._watch_dir(request, ctx)

    async def _watch_dir(
        self,
        request: filesystem_pb.WatchDirRequest,
        ctx: RequestContext[filesystem_pb.WatchDirRequest, filesystem_pb.WatchDirResponse],
    ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        """start{} first; then the changes every POLL_S, and a keepalive when there are none
        for a while (which is also how a client that left is noticed)."""
        session = await self._session(ctx)
        relative = self._watched(request.path)
        with self.watchers.stream(session):
            seen = await call(listing(self.service, session, relative, request.recursive))
            yield filesystem_pb.WatchDirResponse(
                event=Oneof[Literal["start"], Any](
                    "start", filesystem_pb.WatchDirResponse.StartEvent()
                )
            )
            quiet_since = asyncio.get_running_loop().time()
            while True:
                await asyncio.sleep(POLL_S)
                now = await call(listing(self.service, session, relative, request.recursive))
                found = changes(seen, now)
                seen = now
                for name, kind in found:
                    event = filesystem_pb.FilesystemEvent(name=name, type=kind)
                    yield filesystem_pb.WatchDirResponse(
                        event=Oneof[Literal["filesystem"], Any]("filesystem", event)
                    )
                clock = asyncio.get_running_loop().time()
                if found:
                    quiet_since = clock
                elif clock - quiet_since >= WATCH_KEEPALIVE_S:
                    quiet_since = clock
                    yield filesystem_pb.WatchDirResponse(
                        event=Oneof[Literal["keepalive"], Any](
                            "keepalive", filesystem_pb.WatchDirResponse.KeepAlive()
                        )
                    )


def _relative(path: str) -> str:
    with connect_errors():
        return to_workspace(path)


def _entry(info: FileInfo) -> filesystem_pb.EntryInfo:
    return filesystem_pb.EntryInfo(
        name=posixpath.basename(info.path),
        type=_TYPES.get(info.type, filesystem_pb.FileType.UNSPECIFIED),
        path=to_sandbox(info.path),
        size=info.size,
        modified_time=Timestamp.from_datetime(_aware(info.modified_at)),
    )


def _sandbox_entry(entry: sandbox_files.SandboxEntry) -> filesystem_pb.EntryInfo:
    return filesystem_pb.EntryInfo(
        name=posixpath.basename(entry.path),
        type=_TYPES.get(entry.type, filesystem_pb.FileType.UNSPECIFIED),
        path=entry.path,
        size=entry.size,
        modified_time=Timestamp.from_datetime(entry.modified_at),
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.astimezone()


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


def _user(ctx: RequestContext[Any, Any]) -> sandbox_files.User:
    """The call's user (E2B's `user=`, in its Basic authorization): root, or the sandbox's own;
    a user the sandbox does not have is refused (processes.check_user)."""
    return "root" if check_user(ctx.request_headers.get("authorization")) == "root" else None
