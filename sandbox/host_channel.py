"""A sandbox's one way out to the host: a directory bound read-only into it, holding a Unix socket
the host listens on, the tool manifest and the kernel-side module (`import host_tools`).

Why a directory of our own and not the kernel's: the kernel directory is opened to each new
kernel and emptied between kernels; this one is written only by the orchestrator, read-only
inside, and lives as long as the sandbox, so a kernel restart finds the same socket.

Who can connect: as root, the directory and the socket belong to root and the sandbox's group
only (0750/0660), so no other host user and no other sandbox can open them; the listener also
checks the peer's uid (SO_PEERCRED) on every connection. Not as root, the modes are looser and
the uid check is what holds.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.channel_dir import check_socket_path, make_channel_dir
from sandbox.socket_peer import SocketPeer

HOST_TOOLS_DIR_IN_SANDBOX = "/run/host-tools"
# Tells the kernel's start-up file where the module lives (the host path without a sandbox).
HOST_TOOLS_ENV = "CIR_HOST_TOOLS_DIR"
# Where the module reaches the host, where that is not the directory's own socket.
HOST_TOOLS_SOCKET_ENV = "CIR_HOST_TOOLS_SOCKET"
# Which execution, command, background process or terminal started the code that calls a tool:
# a process is given it in this variable; a Python execution in its execute request's metadata,
# under TOOL_ORIGIN_METADATA (the kernel's start-up file reads it; the driver moves it there).
# Each call frame names it, and the host refuses a call whose origin no longer runs.
TOOL_ORIGIN_ENV = "CIR_TOOL_ORIGIN"
TOOL_ORIGIN_METADATA = "cir_tool_origin"
SOCKET_NAME = "sock"
MANIFEST_NAME = "manifest.json"
MODULE_NAME = "host_tools.py"
KERNEL_MODULE = Path(__file__).parent / "inside_kernel" / MODULE_NAME


@dataclass(frozen=True)
class HostChannel:
    """The host side of one sandbox's channel directory."""

    path: Path
    peer_uid: int  # the only uid that may connect: the sandbox's, as the host sees it
    peer_gid: int | None  # the group given the directory (as root), or None
    # The program that must be at the other end, when the uid alone does not say it is the
    # sandbox: under gVisor the host sees its gofer (`runsc-gofer`, root) connect.
    peer_program: str | None = None
    # Told of each file written, once it is in place: where the sandbox cannot read this
    # directory itself (a virtual machine), its backend copies the file in before the write
    # returns, so the sandbox never reads an older one after it.
    mirrors: list[Callable[[str, bytes], None]] = field(default_factory=list, compare=False)

    @classmethod
    def create(
        cls, path: Path, *, peer_uid: int, peer_gid: int | None, peer_program: str | None = None
    ) -> HostChannel:
        """Make the directory with the kernel module in it; `peer_gid` only as root."""
        channel = cls(path, peer_uid, peer_gid if os.geteuid() == 0 else None, peer_program)
        check_socket_path(channel.socket_path, "host-tool")
        make_channel_dir(path, channel.peer_gid)
        channel.write_file(MODULE_NAME, KERNEL_MODULE.read_bytes())
        return channel

    @property
    def socket_path(self) -> Path:
        return self.path / SOCKET_NAME

    def write_file(self, name: str, data: bytes) -> None:
        """Replace a file atomically: the sandbox never reads half of one."""
        tmp = self.path / f".{name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            os.write(fd, data)
            self._share(fd, 0o640)
        finally:
            os.close(fd)
        os.replace(tmp, self.path / name)
        for mirror in self.mirrors:
            mirror(name, data)

    def listen(self, backlog: int = 16) -> socket.socket:
        """Bind the socket, open to the sandbox only, and return it listening (non-blocking)."""
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.socket_path))
            if self.peer_gid is not None:
                os.chown(self.socket_path, 0, self.peer_gid)
                self.socket_path.chmod(0o660)
            else:
                self.socket_path.chmod(0o666)  # the peer-uid check is the gate here
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def peer_allowed(self, conn: socket.socket) -> bool:
        """Whether the process at the other end is the sandbox (its uid; under gVisor, its
        gofer)."""
        return SocketPeer(self.peer_uid, self.peer_program).allows(conn)

    def _share(self, fd: int, group_mode: int) -> None:
        if self.peer_gid is not None:
            os.fchown(fd, 0, self.peer_gid)
            os.fchmod(fd, group_mode)
        else:
            os.fchmod(fd, 0o644)
