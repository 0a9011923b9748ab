"""Per-sandbox directories on the host, and the clean-up of those an earlier crash left behind.

Layout: <state_dir>/<backend>/<sandbox id>/{workspace,kernel,etc,host-tools}/ plus an `owner`
file naming the orchestrator process that made it. A directory whose owner is no longer running is
an orphan.

When the orchestrator runs as root, the workspace is a size-capped tmpfs of its own, mounted here
and bound into the sandbox: a full disk stays inside the session, and the files outlive kernel
restarts (and, on Docker, containers).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_PASSWD = "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:1000:1000:sandbox:/tmp:/bin/sh\n"
_PASSWD += "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
_GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"


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


def _process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _this_process() -> dict[str, object]:
    return {"pid": os.getpid(), "start": _process_start_time(os.getpid())}


@dataclass(frozen=True)
class SessionDirs:
    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def kernel(self) -> Path:
        return self.root / "kernel"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def host_tools(self) -> Path:
        """The host-tool channel's directory, when the sandbox has one (see host_channel.py)."""
        return self.root / "host-tools"

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
        dirs.root.chmod(root_mode)
        (dirs.root / "owner").write_text(json.dumps(_this_process()))
        try:
            dirs.kernel.mkdir(mode=0o700)
            dirs.workspace.mkdir(mode=0o700)
            if owner:
                os.chown(dirs.workspace, *owner)
            if workspace_size_mb and os.geteuid() == 0:
                uid, gid = owner or (0, 0)
                options = f"size={workspace_size_mb}m,mode=0700,uid={uid},gid={gid},nosuid,nodev"
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", options, "cir-workspace", str(dirs.workspace)],
                    check=True,
                    capture_output=True,
                )
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
    def remove_orphans(cls, state_dir: Path, backend: str) -> list[str]:
        """Delete the directories whose orchestrator is gone; never touch a live one's.
        Returns the sandbox ids removed."""
        base = state_dir / backend
        if not base.is_dir():
            return []
        removed: list[str] = []
        for entry in base.iterdir():
            try:
                owner = json.loads((entry / "owner").read_text())
            except (OSError, ValueError):
                owner = None
            if owner and _process_start_time(int(owner["pid"])) == owner.get("start"):
                continue  # its orchestrator is alive
            log.info("removing orphaned sandbox directory %s", entry)
            _remove_tree(entry)
            removed.append(entry.name)
        return removed


def _remove_tree(root: Path) -> None:
    """Unmount the workspace tmpfs, if any, then delete the directory."""
    workspace = root / "workspace"
    if os.path.ismount(workspace):
        subprocess.run(["umount", "--lazy", str(workspace)], check=False, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
