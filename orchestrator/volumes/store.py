"""Volumes on disk, one directory each under the volumes directory:

    <volumes_dir>/<id>/volume.json      who owns it, its name and size (written last)
    <id>/data/                          its files (an ext4 image's mount point, or a directory)
    <id>/data.img                       the image, where volumes are images (disks.py)
    <id>/holders/<session id>           a session that mounts it (its owner inside)
    .lock-<id>                          taken while it is mounted on the host or deleted
    .owner-<hash>.lock                  taken while an owner's volume is made

Kept on disk, not in a database: in a cluster the directory is shared, and what a volume is,
who holds it and the locks travel with it (flock, which NFS v4 carries). Blocking: the
service's part calls it from threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from orchestrator.durable_files import write_new
from orchestrator.volumes import disks

log = logging.getLogger(__name__)
_META = "volume.json"
_ID = re.compile(r"^vol-[0-9a-f]{24}$")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_META_MAX_BYTES = 64 << 10
_DELETING = ".deleting-"
_UNFINISHED_KEPT_S = 3600.0  # a volume directory without its metadata older than this is swept


class VolumeGone(Exception):
    """The volume was deleted (or is being deleted) meanwhile."""


class OverQuota(Exception):
    """A new volume past its owner's count (`count`) or total (the message says which)."""

    def __init__(self, message: str, *, count: bool) -> None:
        super().__init__(message)
        self.count = count


class NotAnImageHere(Exception):
    """A volume made as an image where this service cannot mount images."""


@dataclass(frozen=True)
class VolumeRecord:
    id: str
    name: str
    owner: str
    size_mb: int
    created_at: datetime
    empty_bytes: int | None  # what its image used empty; None: a plain directory


@dataclass(frozen=True)
class OwnerQuota:
    """What one owner's volumes may be, together."""

    max_volumes: int
    max_bytes: int


class VolumeStore:
    def __init__(self, root: Path, *, images: bool) -> None:
        """`images`: each volume an ext4 image of its size (disks.py says when)."""
        self.root = root
        self.images = images

    def create(
        self,
        owner: str,
        name: str,
        size_mb: int,
        quota: OwnerQuota,
        *,
        check: Callable[[list[VolumeRecord]], None] | None = None,
    ) -> VolumeRecord:
        """A new volume, its owner's count and total checked and grown as one step under a lock
        every replica takes (`check`: given the owner's volumes under it, first; it may raise,
        e.g. a name taken)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        with self._owner_lock(owner):
            mine = [r for r in self.all() if r.owner == owner]
            if check is not None:
                check(mine)
            if len(mine) >= quota.max_volumes:
                raise OverQuota(
                    f"your key holds {len(mine)} volumes, the most it may; delete one first",
                    count=True,
                )
            total = sum(r.size_mb for r in mine) + size_mb
            if total << 20 > quota.max_bytes:
                raise OverQuota(
                    f"your volumes would be {total} MiB together, past your key's "
                    f"{quota.max_bytes >> 20} MiB: delete one, or ask for less",
                    count=False,
                )
            return self._make(owner, name, size_mb)

    def _make(self, owner: str, name: str, size_mb: int) -> VolumeRecord:
        volume_id = f"vol-{secrets.token_hex(12)}"
        home = self.root / volume_id
        home.mkdir(mode=0o711)
        try:
            (home / "holders").mkdir(mode=0o700)
            data = home / "data"
            data.mkdir()
            empty: int | None = None
            if self.images:
                disks.make_image(home / "data.img", size_mb)
                disks.mount_image(home / "data.img", data)
                empty = disks.filesystem_bytes(data)
            else:
                disks.share_with_every_session(data)
            record = VolumeRecord(volume_id, name, owner, size_mb, datetime.now(UTC), empty)
            _write_meta(home, record)
        except BaseException:
            _remove(home)
            raise
        return record

    def get(self, volume_id: str) -> VolumeRecord | None:
        if not _ID.match(volume_id):
            return None
        return _read_meta(self.root / volume_id)

    def all(self) -> list[VolumeRecord]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = (_read_meta(self.root / n) for n in sorted(names) if _ID.match(n))
        return [r for r in found if r is not None]

    def data(self, record: VolumeRecord) -> Path:
        """Its data directory, its image mounted there first where it is one (under its lock:
        two first uses never mount it twice)."""
        home = self.root / record.id
        if record.empty_bytes is None:
            return home / "data"
        if not self.images:
            raise NotAnImageHere(
                f"volume {record.id} is an ext4 image, and this service cannot mount images "
                "here (not root, or a cluster's shared directory)"
            )
        with self._lock(record.id):
            if not (home / _META).exists():
                raise VolumeGone(record.id)
            disks.mount_image(home / "data.img", home / "data")
        return home / "data"

    def used_bytes(self, record: VolumeRecord) -> int:
        return disks.used_bytes(self.data(record), empty_bytes=record.empty_bytes)

    def delete(self, record: VolumeRecord, held: Callable[[dict[str, str]], set[str]]) -> set[str]:
        """Delete it unless `held` (given its holders) names sessions that hold it: those are
        returned, and it is kept. Set aside first (renamed), so no new hold can be taken while
        the holders are read; put back if held."""
        home = self.root / record.id
        aside = self.root / f"{_DELETING}{record.id}"
        with self._lock(record.id):
            try:
                os.rename(home, aside)
            except FileNotFoundError:
                raise VolumeGone(record.id) from None
            try:
                holding = held(_holders_in(aside / "holders"))
            except BaseException:
                os.rename(aside, home)
                raise
            if holding:
                os.rename(aside, home)
                return holding
            (aside / _META).unlink(missing_ok=True)
        _remove(aside)
        (self.root / f".lock-{record.id}").unlink(missing_ok=True)  # one waiting finds it gone
        return set()

    def unmount(self, record: VolumeRecord) -> None:
        if record.empty_bytes is not None and self.images:
            with self._lock(record.id):
                disks.unmount(self.root / record.id / "data")

    def sweep(self) -> None:
        """What a create or delete cut short left: set-aside volumes, and volume directories
        without their metadata for an hour (a create under way on another replica has it
        sooner)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            home = self.root / name
            if name.startswith(".lock-") and not (self.root / name[len(".lock-") :]).exists():
                (self.root / name).unlink(missing_ok=True)  # a delete cut short left it
                continue
            unfinished = _ID.match(name) and not (home / _META).exists()
            if name.startswith(_DELETING) or unfinished:
                with contextlib.suppress(OSError):
                    if time.time() - home.stat().st_mtime > _UNFINISHED_KEPT_S:
                        log.warning(
                            "volumes: removing %s, left by a create or delete cut short", name
                        )
                        _remove(home)

    # --- the sessions that mount it
    def hold(self, volume_id: str, session_id: str, owner: str) -> None:
        _check_session_id(session_id)
        try:
            (self.root / volume_id / "holders" / session_id).write_text(owner)
        except FileNotFoundError:
            raise VolumeGone(volume_id) from None

    def release(self, volume_id: str, session_id: str) -> None:
        _check_session_id(session_id)
        for home in (self.root / volume_id, self.root / f"{_DELETING}{volume_id}"):
            (home / "holders" / session_id).unlink(missing_ok=True)

    def holders(self, volume_id: str) -> dict[str, str]:
        """The sessions that mount it, with their owners."""
        return _holders_in(self.root / volume_id / "holders")

    # --- locks every replica takes
    @contextlib.contextmanager
    def _lock(self, volume_id: str) -> Iterator[None]:
        with _flocked(self.root / f".lock-{volume_id}"):
            yield

    @contextlib.contextmanager
    def _owner_lock(self, owner: str) -> Iterator[None]:
        digest = hashlib.sha256(owner.encode()).hexdigest()[:32]
        with _flocked(self.root / f".owner-{digest}.lock"):
            yield


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _holders_in(where: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(where):
            with contextlib.suppress(OSError):
                found[name] = (where / name).read_text()[:256]
    return found


def _remove(home: Path) -> None:
    with contextlib.suppress(OSError):
        disks.unmount(home / "data")

    def failed(_function: object, path: str, error: tuple[type, BaseException, object]) -> None:
        log.warning("volumes: %s could not be removed: %s", path, error[1])

    shutil.rmtree(home, onerror=failed)  # never follows a link the sessions planted


def _check_session_id(session_id: str) -> None:
    if not _SESSION_ID.match(session_id):
        raise ValueError(f"{session_id!r} is not a session id")


def _write_meta(home: Path, record: VolumeRecord) -> None:
    fields = asdict(record) | {"created_at": record.created_at.isoformat()}
    write_new(home / _META, json.dumps(fields).encode(), 0o644)


def _read_meta(home: Path) -> VolumeRecord | None:
    try:
        with open(home / _META, "rb") as f:
            fields = json.loads(f.read(_META_MAX_BYTES))
        empty = fields["empty_bytes"]
        return VolumeRecord(
            id=str(fields["id"]),
            name=str(fields["name"]),
            owner=str(fields["owner"]),
            size_mb=int(fields["size_mb"]),
            created_at=datetime.fromisoformat(fields["created_at"]),
            empty_bytes=None if empty is None else int(empty),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
