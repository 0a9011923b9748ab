"""Saved states of sessions: named snapshots and paused sessions' states, within each key's quota.

A state is saved with sandbox/saved_state.py into a directory the store names, and recorded in
the store under its owner's key digest: no other key can see, resume or start from it. After a
crash, `salvage` keeps what a running session's sandbox left on the host (its workspace's files),
before the backend's clean-up removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from code_interpreter_wire.results import FileInfo
from orchestrator.cluster.leases import lease
from orchestrator.sessions import Session, SessionError
from orchestrator.settings_sections import StorageSection
from orchestrator.state_store import SessionRecord, SnapshotRecord, StateStore
from orchestrator.state_store.records import SnapshotKind
from sandbox.backends.base import Backend
from sandbox.backends.kernel_sandbox import file_info
from sandbox.saved_report import REPORT_FILE, SavedState, StateTooLarge
from sandbox.saved_state import (
    FILES_DIR,
    NAMESPACE_FILE,
    RestoredState,
    copy_files_out,
    restore_state,
    save_state,
)
from sandbox.state_dir import SessionDirs
from sandbox.workspace_files import Workspace

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)


class SnapshotNotFound(SessionError):
    status = 404


class SavedStateTooLarge(SessionError):
    status = 413


class SavedStateQuotaReached(SessionError):
    status = 429


class SnapshotInUse(SessionError):
    """A session is being started from the snapshot: deleting its files now would break it."""

    status = 409


# A fork pins its snapshot unless a delete has begun (KEYS: pins, deleting); a delete begins
# unless a fork pinned it (KEYS: pins, deleting; ARGV: how long the mark lasts): atomically, so
# a snapshot is never deleted from under a fork through another replica.
_PIN = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""
_UNPIN = """
if redis.call('DECR', KEYS[1]) <= 0 then redis.call('DEL', KEYS[1]) end
return 1
"""
_BEGIN_DELETE = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return 1
"""


class SavedStates:
    def __init__(
        self, settings: StorageSection, store: StateStore, shared: RedisConnection | None = None
    ) -> None:
        """`shared`: the Redis every replica shares (cluster mode): saves against a key's
        quota and the snapshots forks start from are then held there, for every replica."""
        self.settings = settings
        self.store = store
        self._shared = shared
        self._owner_locks: dict[str, asyncio.Lock] = {}  # one save at a time per key: quotas hold
        self._pinned: Counter[str] = Counter()  # snapshots sessions are being started from

    async def remove_unrecorded(self) -> int:
        """At start, before any save: delete saved states' directories no row names (a save or
        a salvage a crash cut short). Nothing else would, nor would a quota count them."""
        found = await self.store.orphan_files()
        for path in found:
            if path.is_dir() and not path.is_symlink():
                await asyncio.to_thread(shutil.rmtree, path, True)
            else:
                path.unlink(missing_ok=True)
        if found:
            log.info("removed %d saved states a crash left unrecorded", len(found))
        return len(found)

    async def _room(self, owner: str, kind: SnapshotKind) -> int:
        """The bytes a new state of `owner`'s may take, or the refusal saying why none."""
        s = self.settings
        count, used = await self.store.usage(owner)
        if kind == "snapshot" and count >= s.max_snapshots_per_key:
            raise SavedStateQuotaReached(
                f"this API key keeps its maximum of {s.max_snapshots_per_key} snapshots; "
                "delete one first (DELETE /v1/snapshots/{id})"
            )
        room = min(s.max_saved_state_bytes, s.max_saved_bytes_per_key - used)
        if room <= 0:
            raise SavedStateQuotaReached(
                f"this API key's snapshots and paused sessions take {used} bytes, its quota of "
                f"{s.max_saved_bytes_per_key}; delete snapshots or paused sessions first"
            )
        return room

    async def save(
        self, session: Session, kind: SnapshotKind, name: str | None = None
    ) -> SnapshotRecord:
        """Save a running session's state. `SavedStateTooLarge` / `SavedStateQuotaReached` say
        why it could not be kept; nothing is left of a failed save."""
        lock = self._owner_locks.setdefault(session.owner, asyncio.Lock())
        async with lock, self._owner_lease(session.owner):
            room = await self._room(session.owner, kind)
            snapshot_id = f"snap-{secrets.token_hex(12)}"
            where = self.store.files_of(snapshot_id)
            try:
                report = await self._save(session, kind, where, room)
            except StateTooLarge as exc:
                await asyncio.to_thread(shutil.rmtree, where, True)
                raise SavedStateTooLarge(f"the state cannot be saved: {exc}") from None
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, where, True)
                raise
            record = SnapshotRecord(
                id=snapshot_id,
                owner=session.owner,
                kind=kind,
                name=name,
                session_id=session.id,
                backend=session.backend,
                spec=session.sandbox.spec,
                bytes=report.bytes,
                report=report,
            )
            await self.store.put_snapshot(record)
            return record

    @contextlib.asynccontextmanager
    async def _owner_lease(self, owner: str) -> AsyncIterator[None]:
        """In cluster mode, one save per key across replicas (its quota holds)."""
        if self._shared is None:
            yield
            return
        async with lease(self._shared, f"saves:{owner}", "saving a state for this API key"):
            yield

    @staticmethod
    async def _save(session: Session, kind: SnapshotKind, where: Path, room: int) -> SavedState:
        """A snapshot saves the whole sandbox where its engine can (a fork of it carries on
        its memory and processes); a pause's saved state (the engine could not pause it) and
        every other save, the kernel's variables and the files."""
        if kind == "snapshot":
            try:
                whole = await session.sandbox.save_whole(where, max_bytes=room)
            except StateTooLarge as exc:  # its memory is over the room; its variables may fit
                log.info(
                    "session %s: no whole snapshot (%s); its variables instead", session.id, exc
                )
                whole = None
            if whole is not None:
                return whole
        return await save_state(session.sandbox, where, max_bytes=room)

    async def get(self, owner: str, snapshot_id: str) -> SnapshotRecord:
        """The owner's named snapshot; another key's is reported exactly like a missing one."""
        found = await self.store.get_snapshot(snapshot_id) if _well_formed(snapshot_id) else None
        if found is None or found.owner != owner or found.kind != "snapshot":
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        return found

    async def list(self, owner: str) -> list[SnapshotRecord]:
        return await self.store.snapshots(owner=owner, kind="snapshot")

    @contextlib.asynccontextmanager
    async def pinned(
        self, owner: str, snapshot_id: str | None
    ) -> AsyncIterator[SnapshotRecord | None]:
        """The owner's snapshot (None for None), kept from deletion until the session started
        from it has it: its sandbox is made between finding it and restoring it."""
        if snapshot_id is None:
            yield None
            return
        record = await self.get(owner, snapshot_id)
        await self._pin_shared(record.id)
        self._pinned[record.id] += 1
        try:
            yield await self.get(owner, snapshot_id)  # pinned: it is still there
        finally:
            self._pinned[record.id] -= 1
            if self._pinned[record.id] <= 0:
                del self._pinned[record.id]
            await self._unpin_shared(record.id)

    async def delete(self, owner: str, snapshot_id: str) -> None:
        await self.get(owner, snapshot_id)
        in_use = SnapshotInUse(
            f"a session is being started from snapshot {snapshot_id}; delete it once it has"
        )
        if self._pinned[snapshot_id] > 0:
            raise in_use
        if self._shared is not None:
            with self._shared.errors():
                begun = await self._shared.client.eval(
                    _BEGIN_DELETE, 2, *self._pin_keys(snapshot_id), 600
                )
            if not begun:
                raise in_use
        try:
            await self.store.delete_snapshot(snapshot_id)
        except BaseException:
            if self._shared is not None:  # not deleted after all: forks may pin it again
                with contextlib.suppress(Exception):
                    await self._shared.client.delete(self._pin_keys(snapshot_id)[1])
            raise

    def _pin_keys(self, snapshot_id: str) -> tuple[str, str]:
        assert self._shared is not None
        return self._shared.key("pins", snapshot_id), self._shared.key("deleting", snapshot_id)

    async def _pin_shared(self, snapshot_id: str) -> None:
        """Across replicas (cluster mode): a delete begun elsewhere wins, as if it was gone."""
        if self._shared is None:
            return
        with self._shared.errors():
            pinned = await self._shared.client.eval(_PIN, 2, *self._pin_keys(snapshot_id))
        if not pinned:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} (it is being deleted)")

    async def _unpin_shared(self, snapshot_id: str) -> None:
        if self._shared is None:
            return
        try:
            with self._shared.errors():
                await self._shared.client.eval(_UNPIN, 1, self._pin_keys(snapshot_id)[0])
        except SessionError as exc:  # the pin lapses by itself within the hour
            log.warning("snapshot %s stays pinned for now: %s", snapshot_id, exc)

    async def restore(self, session: Session, record: SnapshotRecord) -> RestoredState:
        return await restore_state(session.sandbox, self.store.files_of(record.id))

    def whole_machine(self, record: SnapshotRecord) -> Path | None:
        """Where a snapshot of a whole sandbox is, to fork a new one from (`Backend.fork`);
        None for a saved kernel state."""
        return self.store.files_of(record.id) if record.report.machine else None

    async def salvage(self, backend: str, engine: Backend) -> int:
        """Turn each session of `backend` the last process left running into a paused one:
        its files from the workspace its sandbox left, its variables from its latest snapshot
        if it has one (else gone, and its next execution says so). Returns how many."""
        found = await self.store.sessions(state="running", backend=backend)
        for record in found:
            suspended = None
            if record.sandbox_id is not None:
                suspended = await engine.suspend_left(record.sandbox_id)
            if suspended is not None:  # the engine kept it whole: nothing is lost
                record.suspended = suspended
                record.notice = "the service restarted; its sandbox was kept whole by its backend"
                await self._pause_record(record, None, state_lost=False)
                continue
            if not engine.capabilities.workspace_on_host:  # its files went with its sandbox
                record.notice = (
                    "the service restarted, and this session's sandbox ended with it: its "
                    "variables and files are gone (its snapshots are kept)"
                )
                await self._pause_record(record, None, state_lost=True)
                continue
            try:
                await self._salvage_one(record)
            except Exception:
                log.exception("the files of session %s could not be kept", record.id)
                record.notice = "the service restarted, and this session's files were lost"
                await self._pause_record(record, None, state_lost=True)
        return len(found)

    async def _salvage_one(self, record: SessionRecord) -> None:
        snapshot_id = f"snap-{secrets.token_hex(12)}"
        where = self.store.files_of(snapshot_id)
        await asyncio.to_thread(where.mkdir, 0o700)
        try:
            await self._salvage_into(record, snapshot_id, where)
        except BaseException:  # nothing is left of a failed salvage
            await asyncio.to_thread(shutil.rmtree, where, True)
            raise

    async def _salvage_into(self, record: SessionRecord, snapshot_id: str, where: Path) -> None:
        room = max(0, self.settings.max_saved_state_bytes)
        report = SavedState()
        workspace = _left_workspace(self.settings.state_dir, record)
        if workspace is not None:
            report.workspace_bytes, report.files = await _copy_host_dir(
                workspace, where / FILES_DIR, room
            )
        latest = next(iter(await self.store.snapshots(session_id=record.id, kind="snapshot")), None)
        if latest is not None and (self.store.files_of(latest.id) / NAMESPACE_FILE).exists():
            await asyncio.to_thread(
                shutil.copyfile,
                self.store.files_of(latest.id) / NAMESPACE_FILE,
                where / NAMESPACE_FILE,
            )
            kept = latest.report
            report = report.model_copy(
                update={
                    k: getattr(kept, k)
                    for k in ("saved", "saved_count", "unsaved", "unsaved_count", "cwd", "python")
                }
                | {"namespace_bytes": kept.namespace_bytes}
            )
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(latest.created_at))
            record.notice = (
                f"the service restarted: variables come from snapshot {latest.id} taken at "
                f"{when} (later changes to them are lost); files are as they were"
            )
        else:
            report.namespace_error = "the service restarted while the session ran"
            record.notice = (
                "the service restarted: the kernel's variables are gone (no snapshot was "
                "taken); files are as they were"
            )
        await asyncio.to_thread((where / REPORT_FILE).write_text, report.model_dump_json())
        await self.store.put_snapshot(
            SnapshotRecord(
                id=snapshot_id,
                owner=record.owner,
                kind="paused",
                session_id=record.id,
                backend=record.backend,
                spec=record.spec,
                bytes=report.bytes,
                report=report,
            )
        )
        await self._pause_record(record, snapshot_id, state_lost=latest is None)

    async def _pause_record(
        self, record: SessionRecord, saved: str | None, *, state_lost: bool
    ) -> None:
        record.state, record.state_since = "paused", time.time()
        record.saved_state, record.state_lost, record.sandbox_id = saved, state_lost, None
        await self.store.put_session(record)


def _well_formed(snapshot_id: str) -> bool:
    return snapshot_id.startswith("snap-") and snapshot_id[5:].isalnum() and len(snapshot_id) < 64


def _left_workspace(state_dir: Path, record: SessionRecord) -> Path | None:
    if record.sandbox_id is None or not record.sandbox_id.replace("-", "").isalnum():
        return None
    path = SessionDirs(state_dir / record.backend / record.sandbox_id).workspace
    return path if path.is_dir() else None


async def _copy_host_dir(root: Path, dest: Path, max_bytes: int) -> tuple[int, int]:
    """Copy the files of a workspace a dead sandbox left, read without following its links
    (its code may still run: a container outlives a killed service until the clean-up)."""
    workspace = Workspace(str(root))

    async def listed() -> list[FileInfo]:
        entries = await asyncio.to_thread(workspace.list_dir, "", recursive=True)
        return [file_info(e) for e in entries]

    async def export(path: str, target: Path, *, max_bytes: int) -> int:
        def copy() -> int:
            with target.open("wb") as sink:
                return workspace.copy_out(path, sink, max_bytes=max_bytes)

        return await asyncio.to_thread(copy)

    return await copy_files_out(listed, export, dest, max_bytes)
