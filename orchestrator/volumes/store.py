"""Volumes on disk, one directory each under the volumes directory:

    <volumes_dir>/<id>/volume.json      who owns it, its name and size (written last)
    <id>/data/                          its files (an ext4 image's mount point, or a directory)
    <id>/data.img                       the image, where volumes are images (disks.py)
    <id>/holders/<session id>           a session that mounts it (its owner inside)

Kept on disk, not in a database: in a cluster the directory is shared, and what a volume is
travels with it. Blocking: the service's part calls it from threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from orchestrator.volumes import disks

_META = "volume.json"
_ID = re.compile(r"^vol-[0-9a-f]{24}$")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_META_MAX_BYTES = 64 << 10


@dataclass(frozen=True)
class VolumeRecord:
    id: str
    name: str
    owner: str
    size_mb: int
    created_at: datetime
    empty_bytes: int | None  # what its image used empty; None: a plain directory


class VolumeStore:
    def __init__(self, root: Path, *, images: bool) -> None:
        """`images`: each volume an ext4 image of its size (disks.py says when)."""
        self.root = root
        self.images = images

    def create(self, owner: str, name: str, size_mb: int) -> VolumeRecord:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
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
            self._remove(home)
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
        """Its data directory, its image mounted there first where it is one."""
        home = self.root / record.id
        if record.empty_bytes is not None:
            disks.mount_image(home / "data.img", home / "data")
        return home / "data"

    def used_bytes(self, record: VolumeRecord) -> int:
        return disks.used_bytes(self.data(record), empty_bytes=record.empty_bytes)

    def delete(self, record: VolumeRecord) -> None:
        home = self.root / record.id
        (home / _META).unlink(missing_ok=True)  # first: a delete cut short leaves no volume
        self._remove(home)

    def unmount(self, record: VolumeRecord) -> None:
        if record.empty_bytes is not None:
            disks.unmount(self.root / record.id / "data")

    def _remove(self, home: Path) -> None:
        with contextlib.suppress(OSError):
            disks.unmount(home / "data")
        shutil.rmtree(home, ignore_errors=True)  # never follows a link the sessions planted

    # --- the sessions that mount it
    def hold(self, volume_id: str, session_id: str, owner: str) -> None:
        _check_session_id(session_id)
        (self.root / volume_id / "holders" / session_id).write_text(owner)

    def release(self, volume_id: str, session_id: str) -> None:
        _check_session_id(session_id)
        (self.root / volume_id / "holders" / session_id).unlink(missing_ok=True)

    def holders(self, volume_id: str) -> dict[str, str]:
        """The sessions that mount it, with their owners."""
        where = self.root / volume_id / "holders"
        found: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(where):
                with contextlib.suppress(OSError):
                    found[name] = (where / name).read_text()[:256]
        return found


def _check_session_id(session_id: str) -> None:
    if not _SESSION_ID.match(session_id):
        raise ValueError(f"{session_id!r} is not a session id")


def _write_meta(home: Path, record: VolumeRecord) -> None:
    fields = asdict(record) | {"created_at": record.created_at.isoformat()}
    partial = home / f".{_META}.partial"
    partial.write_text(json.dumps(fields))
    os.replace(partial, home / _META)


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
