"""The directory of a channel a sandbox reaches on the host (host tools, egress): bound
read-only into the sandbox, holding a Unix socket the host listens on. As root it belongs to
root and the sandbox's group (0750: the sandbox may pass through, never add or remove);
otherwise it is 0755 and the listener's peer check is what holds."""

from __future__ import annotations

import os
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the NUL


def check_socket_path(socket_path: Path, what: str) -> None:
    if len(str(socket_path)) > MAX_SOCKET_PATH:
        raise SandboxStartError(
            f"the {what} socket path {socket_path} is longer than Unix sockets allow; use a "
            "shorter state directory"
        )


def make_channel_dir(path: Path, group: int | None) -> None:
    """Make `path` for a channel; `group`: the sandbox's gid, honoured as root only."""
    path.mkdir(mode=0o700)
    if group is not None and os.geteuid() == 0:
        os.chown(path, 0, group)
        path.chmod(0o750)
    else:
        path.chmod(0o755)
