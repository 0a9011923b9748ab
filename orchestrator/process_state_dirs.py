"""A state dir of its own for each process that runs a service of its own, under a shared one.

One service may hold a state dir at a time (see instance_lock.py), yet several processes start
services on one machine: a desktop client starts one `code-interpreter mcp` per configured
server (each takes `<state dir>/mcp-stdio/<pid>`), and every embedded session runs a private
service (under `<temp dir>/code-interpreter-embedded/<pid>/`). What a crashed one left is removed
by the next one to start: a directory whose process is gone and whose lock is free is provably
dead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from orchestrator.instance_lock import InstanceAlreadyRunning, InstanceLock
from sandbox.backends.registry import BACKENDS, backend_type
from sandbox.state_dir import SessionDirs
from sandbox.tree_removal import remove_tree_at

log = logging.getLogger(__name__)
STDIO_DIR = "mcp-stdio"


def stdio_state_dir(state_dir: Path) -> Path:
    """A stdio MCP server's own state dir; dead siblings are swept first."""
    return own_state_dir(state_dir / STDIO_DIR)


def own_state_dir(base: Path) -> Path:
    """This process's directory under `base` (not made yet); dead siblings are swept first."""
    base.mkdir(mode=0o711, parents=True, exist_ok=True)
    base.chmod(0o711)  # sandbox uids pass through to their own directories, as in the parent
    sweep_dead(base)
    return base / str(os.getpid())


def sweep_dead(base: Path) -> list[Path]:
    """Remove the directories of processes that are gone; return them."""
    removed: list[Path] = []
    for entry in base.iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()) or _alive(int(entry.name)):
            continue
        try:
            lock = InstanceLock.acquire(entry, "sweep")
        except (InstanceAlreadyRunning, OSError):
            continue  # somebody holds it after all
        try:
            for backend in _backends_with_dirs_in(entry):
                SessionDirs.remove_orphans(entry, backend)
            remove_tree_at(entry)
            removed.append(entry)
            log.info("removed the state dir of a process that is gone: %s", entry)
        except OSError:
            log.exception("could not remove %s", entry)
        finally:
            lock.release()
    return removed


def _backends_with_dirs_in(state_dir: Path) -> list[str]:
    """The backends that keep sandbox directories on this host and have some in `state_dir`
    (those mount tmpfs workspaces: removed by `SessionDirs`, not as plain trees). Only their
    modules are imported, not an absent extra's (Ray's)."""
    return [
        name
        for name in BACKENDS
        if (state_dir / name).is_dir() and backend_type(name).capabilities.host_dirs
    ]


def remove_own(state_dir: Path) -> None:
    """On the way out: this process's directory, once its service has closed."""
    with contextlib.suppress(FileNotFoundError):
        remove_tree_at(state_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
