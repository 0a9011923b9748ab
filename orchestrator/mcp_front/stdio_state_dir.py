"""A state dir of its own for each stdio MCP server, under the configured one.

A desktop client starts one `code-interpreter mcp` process per configured server, and several
clients may run at once; one service may hold a state dir at a time (see instance_lock.py), so
each stdio server takes `<state dir>/mcp-stdio/<pid>`. What a crashed one left is removed by the
next one to start: a directory whose process is gone and whose lock is free is provably dead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from orchestrator.instance_lock import InstanceAlreadyRunning, InstanceLock
from sandbox.state_dir import SessionDirs
from sandbox.tree_removal import remove_tree_at

log = logging.getLogger(__name__)
STDIO_DIR = "mcp-stdio"
_BACKENDS_WITH_DIRS = ("local", "docker")


def stdio_state_dir(state_dir: Path) -> Path:
    """This process's own state dir; dead siblings are swept first."""
    base = state_dir / STDIO_DIR
    base.mkdir(mode=0o711, parents=True, exist_ok=True)
    base.chmod(0o711)  # sandbox uids pass through to their own directories, as in the parent
    sweep_dead(base)
    return base / str(os.getpid())


def sweep_dead(base: Path) -> list[Path]:
    """Remove the directories of stdio servers that are gone; return them."""
    removed: list[Path] = []
    for entry in base.iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()) or _alive(int(entry.name)):
            continue
        try:
            lock = InstanceLock.acquire(entry, "sweep")
        except (InstanceAlreadyRunning, OSError):
            continue  # somebody holds it after all
        try:
            for backend in _BACKENDS_WITH_DIRS:
                SessionDirs.remove_orphans(entry, backend)
            remove_tree_at(entry)
            removed.append(entry)
            log.info("removed the state dir of a stdio MCP server that is gone: %s", entry)
        except OSError:
            log.exception("could not remove %s", entry)
        finally:
            lock.release()
    return removed


def remove_own(state_dir: Path) -> None:
    """On the way out: this server's directory, once its service has closed."""
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
