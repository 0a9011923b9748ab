"""A sandbox's state kept outside it: its Python variables and its workspace's files.

Works on every backend through the sandbox's own interface: the kernel writes its namespace
(sandbox/inside_kernel/namespace_state.py) into a hidden file of the workspace, the host copies it
out (`export_file`: a chunk at a time where the backend has the workspace at hand) and keeps it as
opaque bytes: it is only ever loaded again inside a sandbox, never on the host. The workspace's
files are copied the same way into a tree of their own. Restoring does the reverse into a new
sandbox. What could not be saved is named in the report and said in the restore's notice.

A saved state is a directory: `namespace.dill`, `files/` (the workspace), `state.json` (the
report). Whole-process pauses (E2B's own) bypass this (`Sandbox.suspend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

from code_interpreter_wire.errors import FileMissing, FileTooLarge, SandboxError, StateNotSaved
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import FileInfo
from sandbox.backends.base import Sandbox
from sandbox.inside_kernel import namespace_state
from sandbox.saved_report import REPORT_FILE, KernelReport, SavedState, StateTooLarge

NAMESPACE_FILE = "namespace.dill"
FILES_DIR = "files"
FILE_DETAILS = "files.json"  # modes, times and links: what copying files out does not keep
_MAX_DETAILED = 10_000
_MAX_DETAILS_BYTES = 16 << 20
# Where the kernel leaves the namespace for the host to take (hidden; removed at once).
STAGING_DIR = ".cir-state"
_SOURCE = Path(namespace_state.__file__).read_text(encoding="utf-8")
_MAX_ENTRIES = 10_000  # as many as a workspace listing gives


class RestoredState(BaseModel):
    """What a restore brought back, in words a reader (or a model) can act on."""

    restored_count: int = 0
    files: int = 0
    notice: str


async def _run_internal(sandbox: Sandbox, code: str, timeout_s: float) -> dict[str, object]:
    execution = await sandbox.execute(code, timeout_s=timeout_s, language=PYTHON)
    for line in reversed(execution.stdout.split("\n")):
        if line.startswith(namespace_state.REPORT_MARK):
            with contextlib.suppress(ValueError):
                found = json.loads(line[len(namespace_state.REPORT_MARK) :])
                if isinstance(found, dict):
                    return found
            break
    why = execution.error.value if execution.error is not None else execution.status
    raise StateNotSaved(f"the kernel did not report on its state ({why})")


def _call(function: str, *args: object) -> str:
    """Code running namespace_state's `function` in a namespace of its own."""
    call = f"report({function}({', '.join(map(repr, args))}))"
    # The builtin itself: a variable of the user's named `exec` is no concern of ours.
    source = repr(_SOURCE + chr(10) + call)
    return f"__import__('builtins').exec({source}, {{'__name__': '_cir_state'}})"


def _staged(suffix: str = ".dill") -> str:
    """A fresh name in the staging directory, for one file passed between host and kernel."""
    return posixpath.join(STAGING_DIR, f"{secrets.token_hex(8)}{suffix}")


async def save_state(
    sandbox: Sandbox, into: Path, *, max_bytes: int, timeout_s: float = 600.0
) -> SavedState:
    """Save `sandbox`'s Python variables and workspace into the directory `into` (made here),
    within `max_bytes` in all. `StateTooLarge` if the files alone are over it."""
    await asyncio.to_thread(into.mkdir, mode=0o700, parents=True, exist_ok=False)
    state = SavedState(other_languages=[x for x in _started(sandbox) if x != PYTHON])
    staged = _staged()
    try:
        # The files' description first (small): the namespace then takes what room is left.
        state.details_bytes = await _save_file_details(
            sandbox, into / FILE_DETAILS, timeout_s, max_bytes
        )
        room = max_bytes - state.details_bytes
        report = await _run_internal(
            sandbox,
            _call("save", posixpath.join(sandbox.spec.workdir, staged), room),
            timeout_s,
        )
        if "error" in report:
            state.namespace_error = str(report["error"])[:400]
        else:
            try:
                told = KernelReport.model_validate(report)
            except ValidationError:
                raise StateNotSaved("the kernel's report on its state was not understood") from None
            state = state.model_copy(update=told.model_dump())
            state.namespace_bytes = await sandbox.export_file(
                staged, into / NAMESPACE_FILE, max_bytes=room
            )
    finally:
        with contextlib.suppress(SandboxError):
            await sandbox.remove_file(STAGING_DIR)

    async def listed() -> list[FileInfo]:
        return await sandbox.list_files("", recursive=True)

    state.workspace_bytes, state.files = await copy_files_out(
        listed, sandbox.export_file, into / FILES_DIR, max_bytes - state.bytes
    )
    await asyncio.to_thread((into / REPORT_FILE).write_text, state.model_dump_json(), "utf-8")
    return state


async def _save_file_details(sandbox: Sandbox, dest: Path, timeout_s: float, room: int) -> int:
    """Have the kernel describe the workspace's modes, times and links (inside the sandbox,
    as its own user), and keep that beside the files, within `room` bytes; its size."""
    staged = _staged(".json")
    root = sandbox.spec.workdir
    where = posixpath.join(root, staged)
    await _run_internal(
        sandbox, _call("describe_files", root, STAGING_DIR, where, _MAX_DETAILED), timeout_s
    )
    most = min(_MAX_DETAILS_BYTES, room)
    try:
        return await sandbox.export_file(staged, dest, max_bytes=most)
    except FileTooLarge:
        raise StateTooLarge(
            f"the description of the workspace's files is over the {most} bytes it may take; "
            "remove some files first"
        ) from None


def read_report(source: Path) -> SavedState:
    """The report kept with a saved state."""
    return SavedState.model_validate_json((source / REPORT_FILE).read_text(encoding="utf-8"))


async def restore_state(
    sandbox: Sandbox, source: Path, *, timeout_s: float = 600.0
) -> RestoredState:
    """Bring the state saved in `source` into `sandbox` (a new one): files first, then the
    variables; the notice says what came back and what did not."""
    state = await asyncio.to_thread(read_report, source)
    files = await _copy_files_in(sandbox, source / FILES_DIR)
    restored, problem = 0, state.namespace_error
    try:
        if await asyncio.to_thread((source / FILE_DETAILS).exists):
            staged = _staged(".json")
            await sandbox.import_file(staged, source / FILE_DETAILS)
            root, where = sandbox.spec.workdir, posixpath.join(sandbox.spec.workdir, staged)
            await _run_internal(sandbox, _call("apply_files", root, where), timeout_s)
        if await asyncio.to_thread((source / NAMESPACE_FILE).exists):
            staged = _staged()
            await sandbox.import_file(staged, source / NAMESPACE_FILE)
            where = posixpath.join(sandbox.spec.workdir, staged)
            report = await _run_internal(sandbox, _call("restore", where, state.cwd), timeout_s)
            if "error" in report:
                problem = str(report["error"])[:400]
            else:
                count = report.get("restored_count")
                restored = count if isinstance(count, int) else 0
    finally:
        with contextlib.suppress(SandboxError):
            await sandbox.remove_file(STAGING_DIR)
    return RestoredState(
        restored_count=restored, files=files, notice=_notice(state, restored, problem)
    )


def _notice(state: SavedState, restored: int, problem: str | None) -> str:
    parts = [f"{restored} variable(s) and {state.files} file(s) restored"]
    if problem is not None:
        parts.append(f"the variables were not restored: {problem}")
    if state.unsaved:
        listed = "; ".join(f"{name} ({why})" for name, why in state.unsaved.items())
        more = state.unsaved_count - len(state.unsaved)
        tail = f" and {more} more" if more > 0 else ""
        parts.append(f"not saved, so gone: {listed}{tail}. Re-create them")
    if state.other_languages:
        parts.append(
            f"the {', '.join(state.other_languages)} kernel(s) start afresh (only Python's "
            "variables are saved)"
        )
    return "; ".join(parts) + "."


def _started(sandbox: Sandbox) -> list[str]:
    started = getattr(sandbox, "started_languages", None)
    return list(started) if started is not None else [PYTHON]


async def copy_files_out(
    listed: Callable[[], Awaitable[list[FileInfo]]],
    export: Callable[..., Awaitable[int]],
    dest: Path,
    max_bytes: int,
) -> tuple[int, int]:
    """Copy a workspace's files (`listed`; each by `export(path, to, max_bytes=...)`) into the
    directory `dest`; (their bytes, how many files). The staging directory is left out; so is
    what is not a file or a directory (links, sockets), and a file removed since it was listed.
    `StateTooLarge` past `max_bytes` or too many entries."""
    entries = await listed()
    if len(entries) >= _MAX_ENTRIES:
        raise StateTooLarge(
            f"the workspace holds {len(entries)} entries or more: over the {_MAX_ENTRIES} a "
            "saved state can hold; remove some files first"
        )
    await asyncio.to_thread(dest.mkdir, mode=0o700)
    total, files = 0, 0
    for entry in entries:
        parts = entry.path.split("/")
        if parts[0] == STAGING_DIR or entry.name_escaped or entry.type not in ("file", "directory"):
            continue
        if any(p in ("", ".", "..") for p in parts):  # never from a listing; never followed
            continue
        target = dest.joinpath(*parts)
        if entry.type == "directory":
            await asyncio.to_thread(target.mkdir, mode=0o700, parents=True, exist_ok=True)
            continue
        await asyncio.to_thread(target.parent.mkdir, mode=0o700, parents=True, exist_ok=True)
        room = max_bytes - total
        if entry.size > room:
            raise StateTooLarge(
                f"the workspace's files are over the state limit of {max_bytes} bytes; "
                "remove some first"
            )
        try:
            total += await export(entry.path, target, max_bytes=room)
        except FileMissing:  # removed since it was listed (code still runs): not in the state
            await asyncio.to_thread(target.unlink, True)
            continue
        files += 1
    return total, files


async def _copy_files_in(sandbox: Sandbox, source: Path) -> int:
    """Write the saved files into the workspace, through the sandbox's own checks."""
    if not await asyncio.to_thread(source.is_dir):
        return 0
    walked = await asyncio.to_thread(lambda: list(os.walk(source)))
    files = 0
    for root, dirs, names in walked:
        relative = Path(root).relative_to(source)
        if not names and not dirs and relative != Path("."):  # an empty directory: kept
            marker = posixpath.join(relative.as_posix(), ".cir-dir")
            await sandbox.upload(marker, b"")
            await sandbox.remove_file(marker)
        for name in names:
            path = (relative / name).as_posix()
            await sandbox.import_file(path, Path(root) / name)
            files += 1
    return files
