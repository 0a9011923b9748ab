"""A volume's data directory, and what holds it to its size.

Where the service is root on one machine, each volume is an ext4 image of its size, mounted on
the host at its data directory (loop device, nosuid, nodev): a session that writes past the
size gets ENOSPC from the filesystem itself, whatever it runs. Elsewhere (not root, or a
cluster's shared directory, where two machines must never mount one image) the data directory
is a plain directory: its size holds for what is written from outside, and what sessions wrote
is measured and shown (docs/volumes.md says so).

The data directory gives every session's user read and write: mode 0777 with a default POSIX
ACL the same, so what one session (one uid) makes, another may change (the ACL takes the place
of the creator's umask).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

_RUN_S = 120.0
# A first guess at ext4's own room (journal, inode tables) on top of what its files may hold.
_OVERHEAD_MB = 4
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_GROUP_OBJ, _ACL_OTHER = 0x01, 0x04, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_MAX_WALK_ENTRIES = 200_000  # a plain directory's usage is counted up to this many entries


def disks_possible() -> str | None:
    """Why volumes cannot be images here, or None."""
    if os.geteuid() != 0:
        return "the service is not root"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 (e2fsprogs) is not installed"
    if not Path("/dev/loop-control").exists():
        return "there are no loop devices (/dev/loop-control)"
    return None


def share_with_every_session(path: Path) -> None:
    """0777 and a default ACL rwx for all: what any session makes there, any other may change."""
    os.chmod(path, 0o777)
    entries = [(_ACL_USER_OBJ, 7), (_ACL_GROUP_OBJ, 7), (_ACL_OTHER, 7)]
    value = struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", tag, perm, _ACL_UNDEFINED_ID) for tag, perm in entries
    )
    try:
        os.setxattr(path, "system.posix_acl_default", value)
    except OSError as exc:  # a filesystem without ACLs: the umask of each writer then holds
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        log.warning("%s takes no POSIX ACL: files sessions make there are theirs alone", path)


def make_image(image: Path, size_mb: int) -> None:
    """An ext4 image whose files may hold `size_mb` MiB, and little more (blocking): made a
    little larger than that, then grown by what ext4's own structures took (its journal and
    tables grow with it). Its blocks are allocated on the host's disk."""
    _allocate(image, (size_mb + _OVERHEAD_MB) << 20)
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "root_owner=0:0,nodiscard", str(image)])
    for _ in range(4):
        short = (size_mb << 20) - _free_bytes(image)
        if short <= 0:
            return
        _allocate(image, image.stat().st_size + short + (short >> 3) + (1 << 20))
        _run(["resize2fs", "-f", str(image)])
    raise OSError(f"an ext4 image of {size_mb} MiB could not be made to hold as much")


def _allocate(image: Path, size: int) -> None:
    """The image's blocks taken on the host's disk now (never a sparse promise the disk may
    not keep: a full host disk under a mounted ext4 aborts its journal); ENOSPC if they are
    not there."""
    fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _free_bytes(image: Path) -> int:
    said = _run(["dumpe2fs", "-h", str(image)])
    fields = dict(line.split(":", 1) for line in said.splitlines() if ":" in line)
    return int(fields["Free blocks"]) * int(fields["Block size"])


def mount_image(image: Path, at: Path) -> None:
    """Mount `image` at `at` unless it is mounted there already (blocking)."""
    if os.path.ismount(at):
        return
    _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,errors=remount-ro", str(image), str(at)])
    lost = at / "lost+found"  # mkfs's: not the volume's to show; e2fsck makes it again if need be
    with contextlib.suppress(OSError):
        lost.rmdir()
    share_with_every_session(at)


def unmount(at: Path) -> None:
    """Unmount `at` if it is mounted: detached at once where a sandbox still holds it (its
    mount lives on there until the sandbox ends). Blocking."""
    if os.path.ismount(at):
        _run(["umount", "--lazy", str(at)])


def filesystem_bytes(data: Path) -> int:
    """What the mounted filesystem at `data` uses, its own structures included (blocking)."""
    fs = os.statvfs(data)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


def used_bytes(data: Path, *, empty_bytes: int | None) -> int:
    """What the volume's files hold (blocking). `empty_bytes`: what its image used empty,
    where it is one (None: a plain directory, whose files are counted)."""
    if empty_bytes is not None and os.path.ismount(data):
        return max(0, filesystem_bytes(data) - empty_bytes)
    total = seen = 0
    for root, dirs, files in os.walk(data):
        for name in dirs + files:
            seen += 1
            if seen > _MAX_WALK_ENTRIES:
                return total
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, timeout=_RUN_S)
    except subprocess.CalledProcessError as exc:
        said = exc.stderr.decode(errors="replace").strip()[:500]
        raise OSError(f"{argv[0]} failed: {said or exc.returncode}") from None
    except subprocess.TimeoutExpired:
        raise OSError(f"{argv[0]} did not finish in {_RUN_S:g} s") from None
    return done.stdout.decode(errors="replace")
