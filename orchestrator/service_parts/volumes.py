"""Volumes: directories that outlive sessions, owned by a key, with files reached from outside
and mounted into sessions (docs/volumes.md). Another key's volume is reported exactly like a
missing one; a volume a session mounts (running or paused) is not deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

from code_interpreter_wire.results import FileInfo
from code_interpreter_wire.spec import DirectoryMount
from code_interpreter_wire.volumes import CreateVolumeRequest, VolumeInfo, VolumeMount
from orchestrator.governance import audit_kinds as audited
from orchestrator.governance import policy_checks
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.session_error import SessionError
from orchestrator.settings_sections import VolumesSection
from orchestrator.volumes import disks
from orchestrator.volumes.store import VolumeRecord, VolumeStore
from sandbox.backends.kernel_sandbox import file_info
from sandbox.workspace_files import Workspace as Files
from sandbox.workspace_files import clean_path

log = logging.getLogger(__name__)
T = TypeVar("T")
_PENDING = "pending-"  # a holder's name while its session is being made
_PENDING_KEPT_S = 600.0  # a pending hold older than this was a create that died midway


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


class VolumeLimitReached(SessionError):
    """A key holding as many volumes as it may."""

    status = 429


class VolumesUnsupported(SessionError):
    """Volumes asked of a backend that cannot mount them."""

    status = 400


SessionState = Callable[[str, str], Awaitable[object | None]]


class Volumes:
    def __init__(self, settings: VolumesSection, admission: Admission, trail: AuditTrail) -> None:
        self.settings = settings
        self._admission = admission
        self._trail = trail
        # Where a volume is an image: root on one machine (a cluster's shared directory never).
        why_not = disks.disks_possible() if settings.volume_images else "a shared directory"
        self._store = VolumeStore(settings.volumes_dir, images=why_not is None)
        self._why_not_images = why_not
        self._creating = asyncio.Lock()  # a key's total is checked and grown as one step
        self._held: dict[str, list[str]] = {}  # session id -> the volumes it mounts (here)
        self._state: SessionState | None = None  # set by the facade: a session's, live or paused

    def wire(self, state: SessionState) -> None:
        """How a session's state is asked (lifecycle's), made after this part."""
        self._state = state

    # --- volumes
    async def create(self, owner: str, request: CreateVolumeRequest) -> VolumeInfo:
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, writable=True)
        s = self.settings
        size_mb = request.size_mb or s.volume_default_size_mb
        if size_mb > s.volume_max_size_mb:
            raise VolumeTooLarge(
                f"a volume of {size_mb} MiB is larger than this service makes "
                f"({s.volume_max_size_mb} MiB); ask for less"
            )
        async with self._creating:
            mine = [r for r in await asyncio.to_thread(self._store.all) if r.owner == owner]
            if len(mine) >= s.max_volumes_per_key:
                raise VolumeLimitReached(
                    f"your key holds {len(mine)} volumes, the most it may; delete one first"
                )
            total = sum(r.size_mb for r in mine) + size_mb
            if total << 20 > s.max_volume_bytes_per_key:
                raise VolumeTooLarge(
                    f"your volumes would be {total} MiB together, past your key's "
                    f"{s.max_volume_bytes_per_key >> 20} MiB: delete one, or ask for less"
                )
            try:
                record = await asyncio.to_thread(self._store.create, owner, request.name, size_mb)
            except OSError as exc:
                raise VolumesUnsupported(f"the volume could not be made here: {exc}") from None
        self._trail.volume(
            audited.VOLUME_CREATED, owner, record.id, name=record.name, size_mb=size_mb
        )
        return await self._info(record)

    async def of_owner(self, owner: str) -> list[VolumeInfo]:
        records = [r for r in await asyncio.to_thread(self._store.all) if r.owner == owner]
        return [await self._info(r) for r in sorted(records, key=lambda r: r.created_at)]

    async def get(self, owner: str, volume_id: str) -> VolumeInfo:
        return await self._info(await self._record(owner, volume_id))

    async def delete(self, owner: str, volume_id: str) -> None:
        record = await self._record(owner, volume_id)
        holders = await self._holders(record)
        if holders:
            raise VolumeInUse(
                f"volume {volume_id} is mounted by session(s) {', '.join(sorted(holders))}: "
                "end them (or wait for them to end), then delete it"
            )
        await asyncio.to_thread(self._store.delete, record)
        self._trail.volume(audited.VOLUME_DELETED, owner, volume_id)

    # --- its files, from outside
    async def upload(self, owner: str, volume_id: str, path: str, data: bytes) -> FileInfo:
        self._admission.check_upload_size(len(data))
        record = await self._record(owner, volume_id, writing=True)
        clean_path(path)
        used = await asyncio.to_thread(self._store.used_bytes, record)  # before a byte is cut
        if used + len(data) > record.size_mb << 20:
            raise VolumeFull(
                f"volume {volume_id} holds {used} bytes of its {record.size_mb} MiB: "
                f"{len(data)} bytes more do not fit; remove some, or use a larger volume"
            )
        entry = await self._files(record, lambda f: f.write(path, data))
        self._trail.volume(audited.VOLUME_FILE_WRITE, owner, volume_id, path=path, bytes=len(data))
        return file_info(entry)

    async def download(self, owner: str, volume_id: str, path: str) -> bytes:
        record = await self._record(owner, volume_id)
        limit = self.settings.max_download_bytes
        return await self._files(record, lambda f: f.read(path, max_bytes=limit))

    async def list_files(
        self, owner: str, volume_id: str, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        record = await self._record(owner, volume_id)
        entries = await self._files(record, lambda f: f.list_dir(path, recursive=recursive))
        return [file_info(e) for e in entries]

    async def remove_file(self, owner: str, volume_id: str, path: str) -> None:
        record = await self._record(owner, volume_id, writing=True)
        await self._files(record, lambda f: f.remove(path))
        self._trail.volume(audited.VOLUME_FILE_REMOVE, owner, volume_id, path=path)

    async def make_directory(self, owner: str, volume_id: str, path: str) -> None:
        record = await self._record(owner, volume_id, writing=True)
        placeholder = posixpath.join(path, ".cir-make-dir")  # its parents are made with it

        def make(files: Files) -> None:
            files.write(placeholder, b"")
            files.remove(placeholder)

        await self._files(record, make)
        self._trail.volume(audited.VOLUME_FILE_MKDIR, owner, volume_id, path=path)

    # --- in sessions
    @contextlib.asynccontextmanager
    async def reserved(
        self, owner: str, backend_mounts: bool, asked: Sequence[VolumeMount]
    ) -> AsyncIterator[list[DirectoryMount]]:
        """The mounts of a session being made, its volumes held meanwhile (none is deleted
        under it); `hold` names the session once it is made."""
        if not asked:
            yield []
            return
        if not backend_mounts:
            raise VolumesUnsupported(
                "this backend cannot mount volumes: use local or docker (docs/volumes.md)"
            )
        records = [await self._record(owner, v.volume_id) for v in asked]
        mounts = []
        for record, mount in zip(records, asked, strict=True):
            data = await asyncio.to_thread(self._store.data, record)
            mounts.append(
                DirectoryMount(source=str(data), path=mount.path, read_only=mount.read_only)
            )
        token = f"{_PENDING}{int(time.time())}-{secrets.token_hex(6)}"
        for record in records:
            await asyncio.to_thread(self._store.hold, record.id, token, owner)
        try:
            yield mounts
        finally:
            for record in records:
                await asyncio.to_thread(self._store.release, record.id, token)

    async def hold(self, session_id: str, owner: str, asked: Sequence[VolumeMount]) -> None:
        """The made session's volumes are held by it until it ends (paused ones too)."""
        ids = [v.volume_id for v in asked]
        for volume_id in ids:
            await asyncio.to_thread(self._store.hold, volume_id, session_id, owner)
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

    async def released(self, session_id: str) -> None:
        """A session ended: its volumes are free of it."""
        for volume_id in self._held.pop(session_id, []):
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(self._store.release, volume_id, session_id)

    async def start(self) -> None:
        """Every image mounted on the host: a paused session resumed from its record binds its
        volumes' data directories as they are, never an empty mount point."""
        for record in await asyncio.to_thread(self._store.all):
            try:
                await asyncio.to_thread(self._store.data, record)
            except OSError as exc:
                log.warning("volume %s could not be mounted: %s", record.id, exc)

    async def close(self) -> None:
        """Images mounted on the host are unmounted (a sandbox still holding one keeps it)."""
        for record in await asyncio.to_thread(self._store.all):
            try:
                await asyncio.to_thread(self._store.unmount, record)
            except OSError as exc:
                log.warning("volume %s could not be unmounted: %s", record.id, exc)

    # --- the parts of it
    async def _record(self, owner: str, volume_id: str, *, writing: bool = False) -> VolumeRecord:
        with self._admission.enforcing(owner) as who:
            policy_checks.check_volumes(who, writable=writing)
        record = await asyncio.to_thread(self._store.get, volume_id)
        if record is None or record.owner != owner:
            raise VolumeNotFound(f"no volume {volume_id!r} of yours")
        return record

    async def _info(self, record: VolumeRecord) -> VolumeInfo:
        used = await asyncio.to_thread(self._store.used_bytes, record)
        holders = await self._holders(record)
        return VolumeInfo(
            id=record.id,
            name=record.name,
            created_at=record.created_at,
            size_mb=record.size_mb,
            used_bytes=used,
            mounted_by=sorted(h for h in holders if not h.startswith(_PENDING)),
        )

    async def _holders(self, record: VolumeRecord) -> set[str]:
        """The sessions that mount it now, running or paused (stale holders are let go: a
        session that ended with a service that died)."""
        found = await asyncio.to_thread(self._store.holders, record.id)
        holding: set[str] = set()
        for session_id, owner in found.items():
            if session_id.startswith(_PENDING):
                made = session_id[len(_PENDING) :].split("-", 1)[0]
                if made.isdigit() and time.time() - int(made) < _PENDING_KEPT_S:
                    holding.add(session_id)
                    continue
            elif session_id in self._held or (
                self._state is not None and await self._state(session_id, owner) is not None
            ):
                holding.add(session_id)
                continue
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(self._store.release, record.id, session_id)
        return holding

    async def _files(self, record: VolumeRecord, work: Callable[[Files], T]) -> T:
        data: Path = await asyncio.to_thread(self._store.data, record)
        files = Files(str(data), modes=(0o666, 0o777))
        return await asyncio.to_thread(partial(work, files))
