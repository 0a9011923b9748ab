"""Who is at the other end of a Unix socket a sandbox reaches on the host: the sandbox's own
uid (SO_PEERCRED), and, where that uid alone does not say it is the sandbox, the program too.
Under gVisor the host sees the sandbox's gofer (`runsc-gofer`, root) connect on its behalf."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SocketPeer:
    """The peer a channel's socket accepts: `uid` (None: any, for tests), and `program` (the
    basename of its command, read from /proc by the peer's pid) when given."""

    uid: int | None
    program: str | None = None

    def allows(self, conn: socket.socket) -> bool:
        if self.uid is None:
            return True
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid != self.uid:
            return False
        if self.program is None:
            return True
        try:  # the peer's pid as this host sees it: 0 (another pid namespace) fails here
            program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            return False
        return pid > 0 and os.path.basename(program.decode(errors="replace")) == self.program
