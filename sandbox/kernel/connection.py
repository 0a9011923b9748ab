"""Connection files for kernels reached over ZeroMQ `ipc` sockets, with no network at all.

The same directory is seen at two paths: the host's and the sandbox's (usually `/run/kernel`). The
kernel gets a file naming the sandbox path; the client loads the same settings with the host
path. A fresh socket prefix per kernel generation keeps a restarted kernel clear of the old one's
sockets.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

KERNEL_DIR_IN_SANDBOX = "/run/kernel"
_PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "hb_port": 4, "control_port": 5}
# Unix socket paths are capped at 108 bytes (sun_path) including the "-N" suffix and NUL.
MAX_SOCKET_PREFIX = 100


def write_connection_file(
    kernel_dir: Path, in_sandbox: str, generation: int
) -> tuple[str, dict[str, Any]]:
    """Write a fresh connection file; return its in-sandbox path and the host-side settings."""
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
        "key": secrets.token_hex(32),
        "signature_scheme": "hmac-sha256",
        "kernel_name": "python3",
    }
    name = f"conn-{generation}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(kernel_dir / name, flags, 0o644)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    return f"{in_sandbox}/{name}", {**info, "ip": host_ip}


def reset_kernel_dir(kernel_dir: Path) -> None:
    """Empty the directory and open it to the next kernel.

    Called only while nothing of the sandbox runs, so whatever the code planted there (a FIFO
    that would block our open, a symlink our client would follow) is gone before a kernel binds.
    """
    fd = os.open(kernel_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        os.fchmod(fd, 0o777)  # the kernel's uid creates its sockets here
    finally:
        os.close(fd)


def seal_kernel_dir(kernel_dir: Path) -> None:
    """Once the kernel has bound its sockets: nothing may be added, removed or replaced there.

    Effective when the sandbox runs as another uid than ours (Docker; local as root), since
    only the directory's owner could open it again.
    """
    fd = os.open(kernel_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o555)
    finally:
        os.close(fd)
