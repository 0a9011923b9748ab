"""A process's own state dir under a shared one: what a dead process left is swept by the next
to start, sandbox directories included (of the backends that keep them on this host)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.process_state_dirs import own_state_dir, sweep_dead

pytestmark = pytest.mark.unit


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def test_a_dead_processs_directory_goes_with_its_sandbox_directories(tmp_path: Path) -> None:
    dead = tmp_path / str(dead_pid())
    for backend in ("local", "docker", "e2b"):
        (dead / backend / "0123456789abcdef" / "workspace").mkdir(parents=True)
    (dead / "state.db").write_bytes(b"")
    alive = tmp_path / "1"  # init: always running
    alive.mkdir()
    mine = tmp_path / str(os.getpid())
    mine.mkdir()
    assert sweep_dead(tmp_path) == [dead]
    assert not dead.exists() and alive.is_dir() and mine.is_dir()


def test_a_process_gets_a_directory_of_its_own_once_dead_ones_are_gone(tmp_path: Path) -> None:
    dead = tmp_path / str(dead_pid())
    (dead / "local").mkdir(parents=True)
    own = own_state_dir(tmp_path)
    assert own == tmp_path / str(os.getpid()) and not own.exists()  # made by its service
    assert not dead.exists()
    assert tmp_path.stat().st_mode & 0o777 == 0o711


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace tmpfs needs root")
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_a_dead_processs_mounted_workspace_is_unmounted_and_removed(
    tmp_path: Path, backend: str
) -> None:
    """As root, a sandbox's workspace is a tmpfs (sandbox/state_dir.py): a plain removal fails
    on it, so the sweep hands the directories of each backend that keeps them here to
    `SessionDirs`, which unmounts first."""
    pid = dead_pid()
    dead = tmp_path / str(pid)
    sandbox_dir = dead / backend / "0123456789abcdef"
    workspace = sandbox_dir / "workspace"
    workspace.mkdir(parents=True)
    (sandbox_dir / "owner").write_text(json.dumps({"pid": pid, "start": 1}))  # made by `pid`
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "cir", str(workspace)], check=True)
    try:
        (workspace / "left.txt").write_text("by a sandbox")
        assert sweep_dead(tmp_path) == [dead]
        assert not dead.exists()
    finally:
        if str(workspace) in Path("/proc/self/mountinfo").read_text():
            subprocess.run(["umount", "-l", str(workspace)], check=False)
