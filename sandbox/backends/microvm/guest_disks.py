"""A machine's disks (guest_boot.py says how the guest mounts them): ext4 files made with
e2fsprogs' `mkfs.ext4 -d` (a file system filled from a directory, no mount, no root needed).

- The image's root filesystem: its `docker export`, once per image id, read-only and shared by
  every machine of the image (unpacked as the gVisor backend unpacks it, then made ext4).
- A machine's root layer: the overlay's `upper/` and `work/`, holding this session's users
  and this service's programs (the agent, the kernel supervisor, the kernels' start-up files):
  what a gVisor machine has bound in, written in here, so no host file is shared.
- A machine's workspace: empty, owned by the sandbox's uid, its size the workspace quota.
Both per-machine disks are sparse files in the session's directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from code_interpreter_wire.errors import BackendUnavailable, SandboxStartError
from sandbox.backends.gvisor.machine import (
    AGENT_FILES,
    SUDO_FILE,
    SUDO_IN_SANDBOX,
    unpack_rootfs,
)
from sandbox.egress_channel import FORWARDER_FILE, FORWARDER_IN_SANDBOX
from sandbox.kernel.command import KERNEL_START_FILES
from sandbox.kernel.programs import SUPERVISOR_FILE, SUPERVISOR_IN_SANDBOX

ROOTFS_FILE = "rootfs.ext4"
_ROOTFS_SLACK_MB = 256  # free room in the shared root (read-only: for ext4's own metadata)
_MKFS_TIMEOUT_S = 600.0
# This service's programs, written into each machine's root layer (by their paths inside).
PROGRAM_FILES: tuple[tuple[Path, str], ...] = (
    *AGENT_FILES,
    (SUPERVISOR_FILE, SUPERVISOR_IN_SANDBOX),
    *KERNEL_START_FILES,
    (FORWARDER_FILE, FORWARDER_IN_SANDBOX),
    (SUDO_FILE, SUDO_IN_SANDBOX),
)


def mkfs_program() -> str:
    found = shutil.which("mkfs.ext4") or (
        "/usr/sbin/mkfs.ext4" if os.path.exists("/usr/sbin/mkfs.ext4") else None
    )
    if found is None:
        raise BackendUnavailable("mkfs.ext4 (e2fsprogs) is needed to make a machine's disks")
    return found


def _mkfs(target: Path, size_mb: int, *, source: Path | None, owner: tuple[int, int]) -> None:
    argv = [
        mkfs_program(),
        "-q",
        "-F",
        "-m",
        "0",  # no blocks kept for root: the quota is the sandbox's whole
        "-E",
        f"root_owner={owner[0]}:{owner[1]},lazy_itable_init=1,lazy_journal_init=1",
        "-O",
        "^metadata_csum_seed",
    ]
    if source is not None:
        argv += ["-d", str(source)]
    done = subprocess.run(
        [*argv, str(target), f"{size_mb}M"],
        capture_output=True,
        text=True,
        timeout=_MKFS_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise SandboxStartError(f"mkfs.ext4 {target.name} failed: {done.stderr.strip()[-500:]}")


def root_filesystem(client: Any, image: str, store: Path) -> Path:
    """The image's root filesystem as a read-only ext4 file, made once per image id (blocking:
    run it on a thread). The unpacked tree it is made from is removed once it is made."""
    try:
        image_id = str(client.images.get(image).id).removeprefix("sha256:")[:32]
    except Exception as exc:
        raise SandboxStartError(
            f"the kernel image {image!r} is not on the Docker engine (`make image`): {exc}"
        ) from None
    done = store / image_id / ROOTFS_FILE
    if done.is_file():
        return done
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (store / ".disk-lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return done
        tree = unpack_rootfs(client, image, store)
        size_mb = _tree_mb(tree) * 5 // 4 + _ROOTFS_SLACK_MB
        partial = done.with_name(f".{ROOTFS_FILE}.partial")
        _mkfs(partial, size_mb, source=tree, owner=(0, 0))
        os.chmod(partial, 0o600)
        os.rename(partial, done)
        shutil.rmtree(tree, ignore_errors=True)
    return done


def _tree_mb(tree: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(tree):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total >> 20


def make_root_layer(target: Path, size_mb: int, etc: Path, extra: dict[str, bytes]) -> None:
    """The machine's root layer (overlay `upper/` and `work/`) with its users (from `etc`, as
    `write_user_database` wrote them), this service's programs and `extra` (paths inside ->
    contents) in `upper/` (blocking)."""
    with tempfile.TemporaryDirectory(prefix="cir-layer-", dir=target.parent) as staging_dir:
        staging = Path(staging_dir)
        upper = staging / "upper"
        (staging / "work").mkdir(mode=0o700)
        (upper / "etc").mkdir(parents=True)
        for name in ("passwd", "group"):
            shutil.copyfile(etc / name, upper / "etc" / name)
            os.chmod(upper / "etc" / name, 0o644)
        files = {inside: source.read_bytes() for source, inside in PROGRAM_FILES}
        modes = {inside: os.stat(source).st_mode & 0o755 for source, inside in PROGRAM_FILES}
        files.update(extra)
        for inside, data in files.items():
            path = upper / PurePosixPath(inside).relative_to("/")
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            path.write_bytes(data)
            os.chmod(path, modes.get(inside, 0o644) | 0o444)
        for dirpath, dirnames, _ in os.walk(upper):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
        _mkfs(target, size_mb, source=staging, owner=(0, 0))


def make_workspace(target: Path, size_mb: int, owner: tuple[int, int]) -> None:
    """An empty workspace disk of `size_mb`, its root the sandbox's (blocking)."""
    _mkfs(target, max(size_mb, 8), source=None, owner=owner)


def copy_disk(source: Path, target: Path) -> None:
    """Copy a disk file, its holes kept holes (a machine's disks are mostly holes): only the
    written extents are read and written, found with SEEK_DATA and SEEK_HOLE (blocking)."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        size = os.fstat(src.fileno()).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after `offset`
                break
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            while start < end:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), end - start, start, start)
                if copied == 0:
                    break
                start += copied
            offset = end
        os.ftruncate(dst.fileno(), size)
