"""Volumes: directories that outlive sessions, owned by a key, with files reached from outside
and mounted into sessions (docs/volumes.md). Another key's volume is reported exactly like a
missing one; a volume a session mounts (running or paused, on any replica) is not deleted."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

from code_interpreter_wire.errors import FileTooLarge
from code_interpreter_wire.results import FileInfo
from code_interpreter_wire.spec import DirectoryMount
from code_interpreter_wire.volumes import CreateVolumeRequest, VolumeInfo, VolumeMount
from orchestrator.governance import audit_kinds as audited
from orchestrator.governance import policy_checks
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.session_error import SessionError
from orchestrator.settings_sections import VolumesSection
from orchestrator.state_store import SessionRecord
from orchestrator.volumes import disks
from orchestrator.volumes.store import (
    NotAnImageHere,
    OverQuota,
    OwnerQuota,
    VolumeGone,
    VolumeRecord,
    VolumeStore,
)
from sandbox.backends.kernel_sandbox import file_info
from sandbox.workspace_files import Workspace as Files
from sandbox.workspace_files import clean_path

log = logging.getLogger(__name__)
T = TypeVar("T")
_PENDING = "pending-"  # a holder's name while its session is being made
_PENDING_KEPT_S = 3600.0  # a pending hold older than this was a create that died midway
_USED_KEPT_S = 30.0  # how long a plain directory's counted usage is shown before a recount


class VolumeNotFound(SessionError):
    status = 404


class VolumeInUse(SessionError):
    """Deleting a volume a session mounts."""

    status = 409


class VolumeTooLarge(SessionError):
    """A volume larger than the service makes, or past its key's volumes' total."""

    status = 400


class VolumeFull(SessionError):
    """A write from outside past the volume's size."""

    status = 413


class VolumeNameTaken(SessionError):
    """A volume made by a name the key's volumes have already (where names must be unique)."""

    status = 409


class VolumeLimitReached(SessionError):
    """A key holding as many volumes as it may."""

    status = 429


class VolumesUnsupported(SessionError):
    """Volumes asked of a backend that cannot mount them."""

    status = 400


class VolumeUnavailable(SessionError):
    """The volume cannot be reached on this machine now (its image will not mount here)."""

    status = 503


class VolumeSpaceUnavailable(SessionError):
    """The host's disk has no room for a volume of that size."""

    status = 507


SessionState = Callable[[str, str], Awaitable[object | None]]
SessionRecordOf = Callable[[str], Awaitable[SessionRecord | None]]


class Volumes:
    def __init__(self, settings: VolumesSection, admission: Admission, trail: AuditTrail) -> None:
        self.settings = settings
        self._admission = admission
        self._trail = trail
        # Where a volume is an image: root on one machine (a cluster's shared directory never).
        why_not = disks.disks_possible() if settings.volume_images else "a shared directory"
        self._store = VolumeStore(settings.volumes_dir, images=why_not is None)
        self._why_not_images = why_not
        self._held: dict[str, list[str]] = {}  # session id -> the volumes it mounts (here)
        self._writing: dict[str, asyncio.Lock] = {}  # volume id -> its uploads, one at a time
        self._used: dict[str, tuple[float, int]] = {}  # a plain directory's last count
        self._state: SessionState | None = None  # set by the facade: a session, live or paused
        self._record_of: SessionRecordOf | None = None  # a session's record, in the store

    def wire(self, state: SessionState, record_of: SessionRecordOf) -> None:
        """How a session is asked after (lifecycle's and the store's), made after this part."""
        self._state, self._record_of = state, record_of

    async def start(self) -> None:
        """What a create or delete cut short left is swept. Images are mounted on first use
        (a resume makes its volumes ready first: `ready`)."""
        await asyncio.to_thread(self._store.sweep)

    async def close(self) -> None:
        """Images mounted on the host are unmounted (a sandbox still holding one keeps it)."""
        for record in await asyncio.to_thread(self._store.all):
            try:
                await asyncio.to_thread(self._store.unmount, record)
            except OSError as exc:
                log.warning("volume %s could not be unmounted: %s", record.id, exc)

    # --- volumes
    async def create(
        self, owner: str, request: CreateVolumeRequest, *, unique_name: bool = False
    ) -> VolumeInfo:
        """A new volume; `unique_name`: refused (409) if the owner has one of that name (E2B
        finds volumes by name), checked under the lock every replica takes."""
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, writable=True)
        s = self.settings
        size_mb = request.size_mb or s.volume_default_size_mb
        if size_mb > s.volume_max_size_mb:
            raise VolumeTooLarge(
                f"a volume of {size_mb} MiB is larger than this service makes "
                f"({s.volume_max_size_mb} MiB); ask for less"
            )
        quota = OwnerQuota(s.max_volumes_per_key, s.max_volume_bytes_per_key)

        def name_free(mine: list[VolumeRecord]) -> None:  # under the owner's lock
            if unique_name and any(r.name == request.name for r in mine):
                raise VolumeNameTaken(f"you have a volume named {request.name!r} already")

        make = partial(self._store.create, owner, request.name, size_mb, quota, check=name_free)
        try:  # in a thread that finishes under its lock even if the caller leaves
            record = await asyncio.shield(asyncio.to_thread(make))
        except OverQuota as exc:
            raise (VolumeLimitReached if exc.count else VolumeTooLarge)(str(exc)) from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise VolumeSpaceUnavailable(
                    f"the host has no room for a volume of {size_mb} MiB now; ask for less"
                ) from None
            raise VolumeUnavailable(f"the volume could not be made here: {exc}") from None
        self._trail.volume(
            audited.VOLUME_CREATED, owner, record.id, name=record.name, size_mb=size_mb
        )
        return await self._info(record)

    async def of_owner(self, owner: str) -> list[VolumeInfo]:
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, reading=True)
        records = [r for r in await asyncio.to_thread(self._store.all) if r.owner == owner]
        return [await self._info(r) for r in sorted(records, key=lambda r: r.created_at)]

    async def get(self, owner: str, volume_id: str) -> VolumeInfo:
        return await self._info(await self._record(owner, volume_id))

    async def records(self, owner: str) -> list[VolumeRecord]:
        """The owner's volumes as they are kept (no usage counted, no holders read): for a
        front that needs ids and names only."""
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, reading=True)
        found = [r for r in await asyncio.to_thread(self._store.all) if r.owner == owner]
        return sorted(found, key=lambda r: r.created_at)

    async def record(self, owner: str, volume_id: str) -> VolumeRecord:
        """One of the owner's volumes as it is kept (VolumeNotFound otherwise)."""
        return await self._record(owner, volume_id)

    async def delete(self, owner: str, volume_id: str) -> None:
        record = await self._record(owner, volume_id, writing=True)
        loop = asyncio.get_running_loop()

        def held(holders: dict[str, str]) -> set[str]:  # in the store's thread, under its lock
            return asyncio.run_coroutine_threadsafe(self._holding(record, holders), loop).result()

        try:
            holding = await asyncio.shield(asyncio.to_thread(self._store.delete, record, held))
        except VolumeGone:
            raise VolumeNotFound(f"no volume {volume_id!r} of yours") from None
        if holding:
            raise VolumeInUse(
                f"volume {volume_id} is mounted by session(s) {', '.join(sorted(holding))}: "
                "end them (or wait for them to end), then delete it"
            )
        self._used.pop(volume_id, None)
        self._writing.pop(volume_id, None)
        self._trail.volume(audited.VOLUME_DELETED, owner, volume_id)

    # --- its files, from outside
    async def check_writable(self, owner: str, volume_id: str) -> None:
        """Refused now (before an upload's body is read) unless the owner may write to it."""
        await self._record(owner, volume_id, writing=True)

    async def upload(self, owner: str, volume_id: str, path: str, data: bytes) -> FileInfo:
        self._admission.check_upload_size(len(data))
        # Checked again (the route checked before reading the body): the volume may have gone,
        # or the key's rule changed, while the body came.
        record = await self._record(owner, volume_id, writing=True)
        clean_path(path)
        lock = self._writing.setdefault(volume_id, asyncio.Lock())
        async with lock:  # this service's uploads to it, one at a time: each checked in turn
            used = await asyncio.to_thread(self._store.used_bytes, record)
            there = await self._files(record, lambda f: f.stat(path))
            replaced = there.size if there is not None and there.kind == "file" else 0
            if used - replaced + len(data) > record.size_mb << 20:
                raise VolumeFull(
                    f"volume {volume_id} holds {used} bytes of its {record.size_mb} MiB: "
                    f"{len(data)} bytes more do not fit; remove some, or use a larger volume"
                )
            # Beside it, then renamed over it, where both fit at once: a write that fails leaves
            # it as it was; else over it (its old bytes make the room).
            atomic = used + len(data) <= record.size_mb << 20
            try:
                entry = await self._files(
                    record, lambda f: f.copy_in(path, io.BytesIO(data), atomic=atomic)
                )
            except FileTooLarge as exc:  # sessions filled it meanwhile
                raise VolumeFull(f"volume {volume_id} is full: {exc}") from None
            self._used.pop(volume_id, None)
        self._trail.volume(audited.VOLUME_FILE_WRITE, owner, volume_id, path=path, bytes=len(data))
        return file_info(entry)

    async def download(self, owner: str, volume_id: str, path: str) -> bytes:
        record = await self._record(owner, volume_id)
        limit = self._admission.download_limit()
        return await self._files(record, lambda f: f.read(path, max_bytes=limit))

    async def list_files(
        self,
        owner: str,
        volume_id: str,
        path: str = "",
        *,
        recursive: bool = False,
        max_depth: int | None = None,
    ) -> list[FileInfo]:
        """A directory's entries; `max_depth`: directories this far below it are not entered."""
        record = await self._record(owner, volume_id)
        depth = {} if max_depth is None else {"max_depth": max_depth}
        entries = await self._files(
            record, lambda f: f.list_dir(path, recursive=recursive, **depth)
        )
        return [file_info(e) for e in entries]

    async def stat(self, owner: str, volume_id: str, path: str) -> FileInfo | None:
        """What is at `path` in the volume (no link followed), or None."""
        record = await self._record(owner, volume_id)
        entry = await self._files(record, lambda f: f.stat(path))
        return None if entry is None else file_info(entry)

    async def remove_file(self, owner: str, volume_id: str, path: str) -> None:
        record = await self._record(owner, volume_id, writing=True)
        await self._files(record, lambda f: f.remove(path))
        self._used.pop(volume_id, None)
        self._trail.volume(audited.VOLUME_FILE_REMOVE, owner, volume_id, path=path)

    async def make_directory(self, owner: str, volume_id: str, path: str) -> None:
        record = await self._record(owner, volume_id, writing=True)
        await self._files(record, lambda f: f.make_dirs(path))
        self._trail.volume(audited.VOLUME_FILE_MKDIR, owner, volume_id, path=path)

    # --- in sessions
    @contextlib.asynccontextmanager
    async def reserved(
        self, owner: str, backend_mounts: bool, asked: Sequence[VolumeMount]
    ) -> AsyncIterator[list[DirectoryMount]]:
        """The mounts of a session being made, its volumes held meanwhile (a delete sees the
        hold and refuses); `hold` names the session once it is made."""
        if not asked:
            yield []
            return
        if not backend_mounts:
            raise VolumesUnsupported(
                "this backend cannot mount volumes: use local, docker or ray (docs/volumes.md)"
            )
        records = [await self._record(owner, v.volume_id) for v in asked]
        token = f"{_PENDING}{int(time.time())}-{secrets.token_hex(6)}"
        held: list[VolumeRecord] = []
        try:
            mounts = []
            for record, mount in zip(records, asked, strict=True):
                await self._at_host(record, lambda r: self._store.hold(r.id, token, owner))
                held.append(record)
                data = await self._at_host(record, self._store.data)
                mounts.append(
                    DirectoryMount(source=str(data), path=mount.path, read_only=mount.read_only)
                )
            yield mounts
        finally:
            for record in held:
                with contextlib.suppress(OSError, ValueError):
                    await asyncio.to_thread(self._store.release, record.id, token)

    async def hold(self, session_id: str, owner: str, asked: Sequence[VolumeMount]) -> None:
        """The made session's volumes are held by it until it ends (paused ones too)."""
        ids = [v.volume_id for v in asked]
        for volume_id in ids:
            try:
                await asyncio.to_thread(self._store.hold, volume_id, session_id, owner)
            except VolumeGone:
                raise VolumeNotFound(f"volume {volume_id} was deleted meanwhile") from None
        if ids:
            self._held[session_id] = ids
        for v in asked:
            self._trail.volume(
                audited.VOLUME_MOUNTED,
                owner,
                v.volume_id,
                session_id,
                path=v.path,
                read_only=v.read_only,
            )

    async def ready(self, owner: str, mounts: Sequence[DirectoryMount]) -> None:
        """Before a paused session resumes with `mounts`: each is still its owner's volume, its
        image mounted on the host (never the empty mount point under it)."""
        for mount in mounts:
            source = Path(mount.source)
            if source.name != "data" or source.parent.parent != self._store.root:
                raise VolumeUnavailable(f"{mount.path} is not a volume of this service's")
            record = await self._record(owner, source.parent.name)
            await self._at_host(record, self._store.data)

    async def released(self, session_id: str) -> None:
        """A session ended: its volumes are free of it."""
        for volume_id in self._held.pop(session_id, []):
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(self._store.release, volume_id, session_id)

    # --- the parts of it
    async def _record(self, owner: str, volume_id: str, *, writing: bool = False) -> VolumeRecord:
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, reading=True, writable=writing)
        record = await asyncio.to_thread(self._store.get, volume_id)
        if record is None or record.owner != owner:
            raise VolumeNotFound(f"no volume {volume_id!r} of yours")
        return record

    async def _at_host(self, record: VolumeRecord, work: Callable[[VolumeRecord], T]) -> T:
        """`work` on the volume's place on this host, its failures typed."""
        try:
            return await asyncio.to_thread(work, record)
        except VolumeGone:
            raise VolumeNotFound(f"volume {record.id} was deleted meanwhile") from None
        except NotAnImageHere as exc:
            raise VolumeUnavailable(str(exc)) from None
        except OSError as exc:
            raise VolumeUnavailable(f"volume {record.id} cannot be reached here: {exc}") from None

    async def _info(self, record: VolumeRecord) -> VolumeInfo:
        kept = self._used.get(record.id)
        if kept is not None and time.monotonic() - kept[0] < _USED_KEPT_S:
            used = kept[1]
        else:
            used = await self._at_host(record, self._store.used_bytes)
            if record.empty_bytes is None:  # counted file by file: kept a while
                self._used[record.id] = (time.monotonic(), used)
        holders = await asyncio.to_thread(self._store.holders, record.id)
        holding = await self._holding(record, holders)
        return VolumeInfo(
            id=record.id,
            name=record.name,
            created_at=record.created_at,
            size_mb=record.size_mb,
            used_bytes=used,
            mounted_by=sorted(h for h in holding if not h.startswith(_PENDING)),
        )

    async def _holding(self, record: VolumeRecord, holders: dict[str, str]) -> set[str]:
        """Those of `holders` that hold it now: a session being made, or one with a record
        (running or paused, on any replica) or live here. A holder left by a session that ended
        without saying so (a service that died, a paused session deleted) is let go; one whose
        state cannot be told is kept."""
        holding: set[str] = set()
        for session_id, owner in holders.items():
            if session_id.startswith(_PENDING):
                made = session_id[len(_PENDING) :].split("-", 1)[0]
                if made.isdigit() and time.time() - int(made) < _PENDING_KEPT_S:
                    holding.add(session_id)
                    continue
            elif await self._still_there(session_id, owner):
                holding.add(session_id)
                continue
            self._held.pop(session_id, None)
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(self._store.release, record.id, session_id)
        return holding

    async def _still_there(self, session_id: str, owner: str) -> bool:
        try:
            if self._record_of is not None:
                found = await self._record_of(session_id)
                if found is not None and found.owner == owner:
                    return True
            return self._state is not None and await self._state(session_id, owner) is not None
        except Exception:  # a store that cannot answer: held, never deleted under it
            log.warning("volumes: whether session %s still runs is unknown", session_id)
            return True

    async def _files(self, record: VolumeRecord, work: Callable[[Files], T]) -> T:
        data = await self._at_host(record, self._store.data)
        files = Files(str(data), modes=(0o666, 0o777))
        return await asyncio.to_thread(partial(work, files))
