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
    path = kernel_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    for port in _PORTS.values():  # a stale socket from a killed kernel would refuse the bind
        (kernel_dir / f"{prefix}-{port}").unlink(missing_ok=True)
    return f"{in_sandbox}/{name}", {**info, "ip": host_ip}
