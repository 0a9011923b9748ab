"""Files outside the workspace (`/tmp/x`, `/etc/hosts`), reached from inside the sandbox.

E2B's file calls take any path of the sandbox; clients write to /tmp and then run a command on
what they wrote (the Agents SDK's workspace hydration, deepagents' large edits). The files API
reaches only the workspace, so these paths are read and written by small commands run in the
sandbox through `Service`: with the sandbox's user (or its root, where it has one and E2B's
`user="root"` asks for it), its view of the filesystem, its limits; exactly what a command there
would see. A rename (E2B's Move) is such a command too, wherever its
paths are, since the sandbox interface has no rename. Every byte read is capped.

They are file operations, not the key's commands: the service is told so (`file_transfer`, a
parameter no client can set), so a key whose policy forbids commands, or holds them for a
human's approval, still reads and writes files as the workspace's files API lets it.
"""

from __future__ import annotations

import posixpath
import signal
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from code_interpreter_wire.errors import FileAccessError, FileMissing, FileTooLarge, SandboxError
from code_interpreter_wire.processes import CommandResult, ProcessEnd, ProcessOutput, ProcessRequest
from orchestrator.e2b_compatible.processes import INTERNAL_TAG
from orchestrator.service import Service
from orchestrator.sessions import Session
from sandbox.processes.managed import Dropped

TIME_LIMIT_S = 120.0  # one transfer; a larger file than fits in it is refused with the reason
WRITE_CHUNK = 64 << 10
MAX_LISTED = 10_000
_TYPES = {"f": "file", "d": "directory", "l": "symlink"}


@dataclass(frozen=True)
class SandboxEntry:
    path: str  # absolute, in the sandbox
    type: str  # file, directory, symlink, other
    size: int
    modified_at: datetime


User = Literal["root"] | None  # who runs the transfer: the sandbox's user (None), or root


def _request(argv: list[str], user: User, *, stdin: bool = False) -> ProcessRequest:
    return ProcessRequest(
        argv=argv,
        stdin=stdin,
        timeout_s=TIME_LIMIT_S,
        tag=INTERNAL_TAG + uuid.uuid4().hex,
        user=user,
    )


def _failed(result: CommandResult, what: str, path: str) -> SandboxError:
    said = (result.stderr or result.error or "").strip().splitlines()
    reason = said[-1] if said else f"exit status {result.exit_code}"
    if "No such file" in reason or "not found" in reason.lower():
        return FileMissing(f"{path}: no such file or directory")
    return FileAccessError(f"could not {what} {path} in the sandbox: {reason}")


async def _run(service: Service, session: Session, argv: list[str], user: User) -> CommandResult:
    return await service.runs.run_command(session, _request(argv, user), file_transfer=True)


async def read(
    service: Service, session: Session, path: str, max_bytes: int, user: User = None
) -> bytes:
    """The bytes of a file, read by `cat` in the sandbox; FileTooLarge past `max_bytes`."""
    info = await service.runs.start_process(
        session, _request(["cat", "--", path], user), file_transfer=True
    )
    data = bytearray()
    end: ProcessEnd | None = None
    stderr = bytearray()
    events = await service.runs.process_events(session, info.pid, replay=True)
    try:
        async for event in events:
            if isinstance(event, ProcessOutput):
                if event.stream == "stdout":
                    data += event.data
                elif len(stderr) < 4096:
                    stderr += event.data
                if len(data) > max_bytes:
                    raise FileTooLarge(f"{path} is larger than the limit of {max_bytes} bytes")
            elif isinstance(event, Dropped):  # cannot happen while this loop keeps up
                raise FileAccessError(f"reading {path} lost {event.bytes} bytes; try again")
            else:
                end = event
    finally:
        close = getattr(events, "aclose", None)  # stop listening now, not at collection
        if close is not None:
            await close()
        if end is None:
            await service.runs.signal_process(session, info.pid, signal.SIGKILL)
    if end is None:
        raise FileAccessError(f"reading {path} ended without the command's end")
    if end.exit_code != 0:
        reason = stderr.decode(errors="replace").strip() or end.error or "it failed"
        if "No such file" in reason:
            raise FileMissing(f"{path}: no such file or directory")
        if "Is a directory" in reason:
            raise FileAccessError(f"{path} is a directory")
        raise FileAccessError(f"could not read {path} in the sandbox: {reason}")
    return bytes(data)


async def write(
    service: Service, session: Session, path: str, data: bytes, user: User = None
) -> None:
    """Write a file (its parents made), fed to `cat` on its stdin in the sandbox."""
    script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
    info = await service.runs.start_process(
        session,
        _request(["/bin/sh", "-c", script, "sh", path], user, stdin=True),
        file_transfer=True,
    )
    try:
        for start in range(0, len(data), WRITE_CHUNK):
            chunk = data[start : start + WRITE_CHUNK]  # the file, not input: not recorded as such
            await service.runs.send_input(session, info.pid, chunk, file_transfer=True)
        await service.runs.close_input(session, info.pid)
    except SandboxError:
        pass  # it ended early: its result says why
    result = await service.runs.wait_process(session, info.pid)
    if result.exit_code != 0:
        raise _failed(result, "write", path)


async def stat(service: Service, session: Session, path: str, user: User = None) -> SandboxEntry:
    result = await _run(service, session, ["stat", "-c", "%F|%s|%Y", "--", path], user)
    if result.exit_code != 0:
        raise _failed(result, "stat", path)
    kind, size, mtime = result.stdout.strip().split("|")
    kinds = {"regular file": "file", "regular empty file": "file", "directory": "directory"}
    return SandboxEntry(
        path=path,
        type=kinds.get(kind, "symlink" if kind == "symbolic link" else "other"),
        size=int(size),
        modified_at=datetime.fromtimestamp(int(mtime), UTC),
    )


async def list_dir(
    service: Service, session: Session, path: str, depth: int, user: User = None
) -> list[SandboxEntry]:
    """The entries under a directory, to `depth` levels (at most MAX_LISTED)."""
    entry = await stat(service, session, path, user)
    if entry.type != "directory":
        raise FileAccessError(f"{path} is not a directory")
    argv = ["find", path, "-mindepth", "1", "-maxdepth", str(depth), "-printf", "%y|%s|%T@|%p\\0"]
    result = await _run(service, session, argv, user)
    if result.exit_code != 0 and not result.stdout:
        raise _failed(result, "list", path)
    if result.stdout_dropped:
        raise FileAccessError(f"{path} holds too many entries to list here; list a deeper one")
    found = []
    for line in result.stdout.split("\0")[:MAX_LISTED]:
        if line.count("|") < 3:
            continue  # the last, empty piece
        kind, size, mtime, name = line.split("|", 3)
        if not (size.isdigit() and mtime.replace(".", "", 1).isdigit()):
            continue
        found.append(
            SandboxEntry(
                path=name,
                type=_TYPES.get(kind, "other"),
                size=int(size),
                modified_at=datetime.fromtimestamp(float(mtime), UTC),
            )
        )
    return found


async def remove(service: Service, session: Session, path: str, user: User = None) -> None:
    await stat(service, session, path, user)  # missing: NOT_FOUND, as envd says
    result = await _run(service, session, ["rm", "-rf", "--", path], user)
    if result.exit_code != 0:
        raise _failed(result, "remove", path)


async def make_dir(service: Service, session: Session, path: str, user: User = None) -> None:
    result = await _run(service, session, ["mkdir", "-p", "--", path], user)
    if result.exit_code != 0:
        raise _failed(result, "make the directory", path)


async def move(
    service: Service, session: Session, source: str, destination: str, user: User = None
) -> None:
    """Rename `source` to `destination` (absolute sandbox paths), making its parents."""
    await stat(service, session, source, user)  # missing: NOT_FOUND "source file not found"
    parent = posixpath.dirname(destination)
    result = await _run(
        service,
        session,
        [
            "/bin/sh",
            "-c",
            'mkdir -p -- "$1" && mv -T -- "$2" "$3"',
            "sh",
            parent,
            source,
            destination,
        ],
        user,
    )
    if result.exit_code != 0:
        raise _failed(result, "move", source)
