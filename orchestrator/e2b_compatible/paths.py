"""E2B paths and workspace paths.

E2B's file calls take absolute paths in the sandbox (or paths relative to the user's home). Here
every sandbox's files are its workspace, which the code sees at /workspace, its working
directory: `/workspace/a.csv` and `a.csv` both name the workspace's `a.csv`. Any other absolute
path (E2B's `/home/user` included) is refused rather than silently mapped, since code running in
the sandbox would not find the file there.
"""

from __future__ import annotations

import posixpath

from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.errors import InvalidPath
from sandbox.workspace_files import clean_path


def to_workspace(path: str) -> str:
    """The workspace-relative path an E2B path names, or InvalidPath."""
    if path.startswith("/"):
        normal = posixpath.normpath(path)
        if normal == WORKSPACE_IN_SANDBOX:
            return ""
        if not normal.startswith(WORKSPACE_IN_SANDBOX + "/"):
            raise InvalidPath(
                f"{path!r} is outside {WORKSPACE_IN_SANDBOX}: this server's sandboxes keep their "
                f"files in {WORKSPACE_IN_SANDBOX}, the code's working directory; give a path "
                "relative to it or under it"
            )
        path = normal[len(WORKSPACE_IN_SANDBOX) + 1 :]
    return "/".join(clean_path(path, allow_root=True))


def to_sandbox(relative: str) -> str:
    """The absolute path the code sees for a workspace-relative path."""
    return posixpath.join(WORKSPACE_IN_SANDBOX, relative) if relative else WORKSPACE_IN_SANDBOX
