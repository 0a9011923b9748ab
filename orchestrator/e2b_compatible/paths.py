"""E2B paths and workspace paths.

E2B's calls take absolute paths in the sandbox, or paths relative to the user's home,
`/home/user`. Here the sandbox user's files are its workspace, which the code sees at /workspace,
its working directory; so E2B's home names the workspace: `/home/user/a.csv`, `/workspace/a.csv`
and `a.csv` are the same file, and a process asked to start in `/home/user` starts in
/workspace. Any other absolute path (`/tmp/x`, `/etc/hosts`) is a path inside the sandbox,
reached through the sandbox itself (see sandbox_files.py), exactly as a command there sees it.
"""

from __future__ import annotations

import posixpath

from code_interpreter_wire.errors import InvalidPath
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.workspace_files import clean_path

E2B_HOME = "/home/user"


def _home_to_workspace(path: str) -> str:
    """`path` with E2B's home (or `~`) spelled as the workspace; other paths unchanged."""
    if path == "~" or path.startswith("~/"):
        path = E2B_HOME + path[1:]
    if path.startswith("/"):
        normal = posixpath.normpath(path)
        if normal == E2B_HOME or normal.startswith(E2B_HOME + "/"):
            return WORKSPACE_IN_SANDBOX + normal[len(E2B_HOME) :]
        return normal
    return path


def in_workspace(path: str) -> bool:
    """Whether an E2B path names a file of the workspace (so the files API can reach it)."""
    absolute = _home_to_workspace(path)
    if not absolute.startswith("/"):
        return True
    return absolute == WORKSPACE_IN_SANDBOX or absolute.startswith(WORKSPACE_IN_SANDBOX + "/")


def to_workspace(path: str) -> str:
    """The workspace-relative path an E2B path in the workspace names (see `in_workspace`);
    InvalidPath for a path that leaves it (`..`)."""
    path = _home_to_workspace(path)
    if path.startswith("/"):
        if path == WORKSPACE_IN_SANDBOX:
            return ""
        if not path.startswith(WORKSPACE_IN_SANDBOX + "/"):
            raise InvalidPath(
                f"{path!r} is outside {WORKSPACE_IN_SANDBOX}: this call reaches the workspace "
                f"({WORKSPACE_IN_SANDBOX}, which E2B's home {E2B_HOME} names) only; give a path "
                "relative to it or under it"
            )
        path = path[len(WORKSPACE_IN_SANDBOX) + 1 :]
    return "/".join(clean_path(path, allow_root=True))


def in_sandbox(path: str) -> str:
    """The absolute path, as the sandbox sees it, of any E2B path (relative: to the home)."""
    path = _home_to_workspace(path)
    if not path.startswith("/"):
        path = posixpath.join(WORKSPACE_IN_SANDBOX, path)
    return posixpath.normpath(path)


def to_sandbox(relative: str) -> str:
    """The absolute path the code sees for a workspace-relative path."""
    return posixpath.join(WORKSPACE_IN_SANDBOX, relative) if relative else WORKSPACE_IN_SANDBOX


def to_sandbox_cwd(cwd: str) -> str | None:
    """A process's working directory: E2B's home (the default, also for an empty cwd) is the
    workspace; a relative one is under it."""
    return in_sandbox(cwd) if cwd else None
