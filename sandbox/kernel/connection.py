"""Connection files for kernels reached over ZeroMQ `ipc` sockets, with no network at all.

The same directory is seen at two paths: the host's and the sandbox's (usually `/run/kernel`). The
kernel gets a file naming the sandbox path; the client loads the same settings with the host
path. A fresh socket prefix per kernel generation keeps a restarted kernel clear of the old one's
sockets.

Who may read what: the connection file holds the kernel's HMAC key, so it is the kernel's uid's
alone (0600); the directory is the kernel's (0700) only while it starts, then sealed. A kernel uid
of None means the kernel runs as the service's own uid.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from sandbox.dir_stack import DIR_FLAGS
from sandbox.tree_removal import remove_tree

KERNEL_DIR_IN_SANDBOX = "/run/kernel"
_PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "hb_port": 4, "control_port": 5}
# Unix socket paths are capped at 108 bytes (sun_path) including the "-N" suffix and NUL.
MAX_SOCKET_PREFIX = 100


def write_connection_file(
    kernel_dir: Path,
    in_sandbox: str,
    generation: int,
    kernel_uid: int | None = None,
    key: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Write a fresh connection file (with a fresh key, unless a kernel already running keeps
    its own); return its in-sandbox path and the host-side settings."""
    prefix = f"k{generation}"
    host_ip = str(kernel_dir / prefix)
    if len(host_ip) > MAX_SOCKET_PREFIX:
        raise ValueError(
            f"kernel socket path {host_ip!r} is longer than Unix sockets allow; "
            "use a shorter state directory"
        )
    info: dict[str, Any] = {
        **_PORTS,
        "transport": "ipc",
        "ip": f"{in_sandbox}/{prefix}",
        "key": key or secrets.token_hex(32),
        "signature_scheme": "hmac-sha256",
        "kernel_name": "python3",
    }
    name = f"conn-{generation}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(kernel_dir / name, flags, 0o600)
    try:
        _give_to_kernel(fd, kernel_uid, private=0o600, shared=0o644)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    return f"{in_sandbox}/{name}", {**info, "ip": host_ip}


def reset_kernel_dir(kernel_dir: Path, kernel_uid: int | None = None) -> None:
    """Empty the directory and give it to the next kernel's uid alone.

    Called only while nothing of the sandbox runs, so whatever the code planted there (a FIFO
    that would block our open, a symlink our client would follow) is gone before a kernel binds.
    """
    fd = os.open(kernel_dir, DIR_FLAGS)
    try:
        for name in os.listdir(fd):
            remove_tree(fd, name)  # any depth: the code may have planted a tree here
        _give_to_kernel(fd, kernel_uid, private=0o700, shared=0o777)  # it binds its sockets here
    finally:
        os.close(fd)


def seal_kernel_dir(kernel_dir: Path) -> None:
    """Once the kernel has bound its sockets: nothing may be added, removed or replaced there.

    Effective when the sandbox runs as another uid than ours (Docker; local as root), since
    only the directory's owner could open it again.
    """
    fd = os.open(kernel_dir, DIR_FLAGS)
    try:
        os.fchown(fd, os.geteuid(), os.getegid())  # ours again: the kernel could chmod its own
        os.fchmod(fd, 0o555)
    finally:
        os.close(fd)


def _give_to_kernel(fd: int, kernel_uid: int | None, *, private: int, shared: int) -> None:
    """Make `fd` the kernel's alone (`private` mode). A service that is neither root nor the
    kernel's uid cannot give a file away: then only the looser `shared` mode lets the kernel in."""
    if kernel_uid is None or kernel_uid == os.geteuid():
        os.fchmod(fd, private)
    elif os.geteuid() == 0:
        os.fchown(fd, kernel_uid, -1)
        os.fchmod(fd, private)
    else:
        os.fchmod(fd, shared)
