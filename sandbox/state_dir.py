"""Per-sandbox directories on the host, and the clean-up of those an earlier crash left behind.

Layout: <state_dir>/<backend>/<sandbox id>/{workspace,kernel,etc,host-tools}/ plus an `owner`
file naming the orchestrator process that made it. A directory whose owner is no longer running is
an orphan.

When the orchestrator runs as root, the workspace is a size-capped tmpfs of its own, mounted here
and bound into the sandbox: a full disk stays inside the session, and the files outlive kernel
restarts (and, on Docker, containers). The sandbox's directory and its kernel directory are then
small tmpfs mounts too, so that what the sandbox sees of its binds in /proc/self/mountinfo (each
mount's path within its own filesystem) names neither the state dir nor a sandbox id: only `/`,
`/etc/passwd`, `/host-tools`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.host_commands import HOST_ENVIRONMENT, system_program
from sandbox.process_identity import process_start_time
from sandbox.tree_removal import remove_tree_at

log = logging.getLogger(__name__)

_PASSWD = "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:1000:1000:sandbox:/tmp:/bin/sh\n"
_PASSWD += "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
_GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"
# The sandbox's own directory holds small files only (passwd, group, the host-tool module and
# manifest); the kernel directory holds connection files and sockets.
_ROOT_TMPFS = "size=4m,nr_inodes=1024"
_KERNEL_TMPFS = "size=1m,nr_inodes=256"
# A directory without an owner file is an orphan only once older than this: another process may
# be making it now (tests run several orchestrators on one state dir; a service runs alone).
_OWNERLESS_GRACE_S = 120.0


def default_state_dir() -> Path:
    """A private directory of this user's, short enough for Unix socket paths."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "code-interpreter"
    return Path(f"/tmp/code-interpreter-{os.geteuid()}")


def _private_dir(path: Path, mode: int) -> None:
    """Create `path`, or accept it only if it is ours and not a symlink."""
    try:
        path.mkdir(mode=mode, parents=False)
    except FileExistsError:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(
                f"{path} exists but is not a directory of this user's; remove it or choose "
                "another state directory"
            ) from None
    path.chmod(mode)


def _this_process() -> dict[str, object]:
    return {"pid": os.getpid(), "start": process_start_time(os.getpid())}


@dataclass(frozen=True)
class SessionDirs:
    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def kernel(self) -> Path:
        return self.root / "kernel"

    def kernel_of(self, language: str) -> Path:
        """The kernel directory of `language`'s kernel: Python's is `kernel`; each other
        language has one of its own, made on first use (the driver empties and seals each one
        on its own kernel's schedule)."""
        if language == "python":
            return self.kernel
        path = self.root / f"kernel-{language}"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def host_tools(self) -> Path:
        """The host-tool channel's directory, when the sandbox has one (see host_channel.py)."""
        return self.root / "host-tools"

    @property
    def egress(self) -> Path:
        """The egress channel's directory, when the sandbox has a network (egress_channel.py)."""
        return self.root / "egress"

    @classmethod
    def create(
        cls,
        state_dir: Path,
        backend: str,
        sandbox_id: str,
        *,
        workspace_size_mb: int | None = None,
        owner: tuple[int, int] | None = None,
        root_mode: int = 0o711,
    ) -> SessionDirs:
        """Make the directories; `owner` gets the workspace. The kernel directory stays ours:
        the driver opens it to each new kernel and seals it once the sockets are bound."""
        # 0711: sandboxes running as their own uid may pass through, but not list.
        state_dir.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(state_dir, 0o711)
        _private_dir(state_dir / backend, 0o711)
        dirs = cls(state_dir / backend / sandbox_id)
        dirs.root.mkdir(mode=root_mode)
        # As root, a sandbox with a workspace of its own size gets private mounts; otherwise
        # (no sandbox at all, or not root) the directories stay plain ones on disk.
        private_mounts = bool(workspace_size_mb) and os.geteuid() == 0
        try:
            if private_mounts:
                _mount_tmpfs(dirs.root, f"{_ROOT_TMPFS},mode={root_mode:o},uid=0,gid=0")
            dirs.root.chmod(root_mode)
            (dirs.root / "owner").write_text(json.dumps(_this_process()))
            dirs.kernel.mkdir(mode=0o700)
            if private_mounts:
                _mount_tmpfs(dirs.kernel, f"{_KERNEL_TMPFS},mode=0700,uid=0,gid=0,noexec")
            dirs.workspace.mkdir(mode=0o700)
            if owner:
                os.chown(dirs.workspace, *owner)
            if private_mounts:
                uid, gid = owner or (0, 0)
                options = f"size={workspace_size_mb}m,mode=0700,uid={uid},gid={gid}"
                _mount_tmpfs(dirs.workspace, options)
            dirs.etc.mkdir(mode=0o755)
            (dirs.etc / "passwd").write_text(_PASSWD)
            (dirs.etc / "group").write_text(_GROUP)
        except BaseException:
            dirs.remove()
            raise
        return dirs

    def remove(self) -> None:
        _remove_tree(self.root)

    @classmethod
    def orphans(cls, state_dir: Path, backend: str) -> list[Path]:
        """The directories whose orchestrator is gone; never a live one's, nor one being made."""
        base = state_dir / backend
        if not base.is_dir():
            return []
        found: list[Path] = []
        for entry in base.iterdir():
            try:
                owner = json.loads((entry / "owner").read_text())
            except (OSError, ValueError):
                owner = None
            if owner and process_start_time(int(owner["pid"])) == owner.get("start"):
                continue  # its orchestrator is alive
            if owner is None and _younger_than(entry, _OWNERLESS_GRACE_S):
                continue  # being made right now (its owner file comes after its mounts)
            found.append(entry)
        return found

    @classmethod
    def remove_orphans(cls, state_dir: Path, backend: str) -> list[str]:
        """Delete the directories whose orchestrator is gone; never touch a live one's.
        Returns the sandbox ids removed."""
        removed: list[str] = []
        for entry in cls.orphans(state_dir, backend):
            log.info("removing orphaned sandbox directory %s", entry)
            _remove_tree(entry)
            removed.append(entry.name)
        return removed


def _younger_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime < seconds
    except OSError:
        return False


def _mount_tmpfs(path: Path, options: str) -> None:
    """Mount a tmpfs of its own on `path`; its source name says what it is, nothing more."""
    subprocess.run(
        [system_program("mount"), "-t", "tmpfs", "-o", f"{options},nosuid,nodev", "cir", str(path)],
        check=True,
        capture_output=True,
        env=HOST_ENVIRONMENT,
    )


def _mounts_under(root: Path) -> list[str]:
    """The mount points at or below `root`, deepest first."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode(errors="surrogateescape").splitlines()
    except OSError:
        return []
    top = os.path.realpath(root)
    found = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            # mountinfo escapes space, tab, newline and backslash as \ooo.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == top or point.startswith(top + "/"):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def _unmount_all(root: Path) -> None:
    """Unmount every mount at or below `root` (workspace, kernel dir, the root itself)."""
    for _ in range(8):  # a point mounted twice needs a second round
        points = _mounts_under(root)
        if not points:
            return
        for point in points:
            subprocess.run(
                [system_program("umount"), "--lazy", point],
                check=False,
                capture_output=True,
                env=HOST_ENVIRONMENT,
            )


def _remove_tree(root: Path) -> None:
    """Unmount the workspace tmpfs, if any, then delete the directory: without recursion, since
    the sandbox may have left a tree there deeper than recursion or PATH_MAX allow."""
    _unmount_all(root)
    try:
        remove_tree_at(root)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove all of %s: %s", root, exc)
