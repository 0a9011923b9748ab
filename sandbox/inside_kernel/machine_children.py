"""The processes a gVisor machine's agent starts, and what it asks of the machine about them.

A child (kernel, command, terminal) outlives any one host connection: a restore hands the agent
new pipes, and a new host adopts what the last one started. So each keeps a bounded tail of its
output here, for whoever adopts it. Starting one (pipes or a terminal, its own session, the
sandbox's uid), signalling it and whatever carries its marker, and listing what gVisor could not
save are plain system calls, kept apart from the agent's event loop (machine_agent.py).

Standard library only: it runs inside the machine, imported by the agent as a sibling file.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import pty
import struct
import subprocess
import termios
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox.inside_kernel.machine_wire import Stream

TAIL_BYTES = 256 << 10  # what is kept of each child's output for the host that adopts it
MAX_CHILDREN = 512
MARKER_VARIABLE = "CODE_INTERPRETER_PROCESS"


class Child:
    """A process the agent started, whose output outlives any one host connection."""

    def __init__(self, pid: int, tag: str, tty: bool, marker: str) -> None:
        self.pid = pid
        self.tag = tag
        self.tty = tty
        self.marker = marker
        self.out: dict[str, int] = {}  # its output fds: "io" (stdout or terminal), "err"
        self.input = -1  # its stdin pipe, or a dup of its terminal's master
        self.tails: dict[str, deque[bytes]] = {"io": deque(), "err": deque()}
        self.tail_sizes = {"io": 0, "err": 0}
        self.unsent = {"io": 0, "err": 0}  # the tail's last bytes, kept while no host listened
        self.streams: dict[str, Stream[Child] | None] = {"io": None, "err": None}
        self.exit: dict[str, int] | None = None

    def keep(self, name: str, data: bytes) -> None:
        tail = self.tails[name]
        tail.append(data)
        self.tail_sizes[name] += len(data)
        while self.tail_sizes[name] > TAIL_BYTES and len(tail) > 1:
            self.tail_sizes[name] -= len(tail.popleft())


def write_files(items: list[dict[str, Any]], uid: int, gid: int) -> None:
    """The files a spawn request brings (`{"path", "data" (base64), "mode"}`), the child's."""
    for item in items:
        data = base64.b64decode(item["data"])
        _write_file(str(item["path"]), data, int(item["mode"]), uid, gid)


def start_child(request: dict[str, Any], uid: int, gid: int, *, with_err: bool) -> Child:
    """Start what a spawn request asks for, in a session of its own, on a terminal or on pipes
    (stderr apart if `with_err`); its ends are closed here, ours non-blocking in the Child."""
    env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
    marker = str(request.get("marker") or "")
    if marker:
        env[MARKER_VARIABLE] = marker
    tty = request.get("tty")
    ours: list[int] = []  # our ends, closed if it does not start
    theirs: list[int] = []  # its ends, closed once it started
    try:
        if tty:
            master, slave = pty.openpty()
            ours.append(master)
            theirs.append(slave)
            set_size(master, int(tty["rows"]), int(tty["cols"]))
            stdin = stdout = stderr = slave
            out = {"io": master}
            ours.append(os.dup(master))
            child_input = ours[-1]
        else:
            in_r, child_input = os.pipe()
            out_r, out_w = os.pipe()
            ours += [child_input, out_r]
            theirs += [in_r, out_w]
            stdin, stdout, stderr = in_r, out_w, out_w
            out = {"io": out_r}
            if with_err:
                err_r, err_w = os.pipe()
                ours.append(err_r)
                theirs.append(err_w)
                stderr = err_w
                out["err"] = err_r
            for fd in theirs:  # its own, so it may open them again (/dev/stdout, /dev/stderr)
                with contextlib.suppress(OSError):  # gVisor's pipes take no owner: as they are
                    os.fchown(fd, uid, gid)
        process = subprocess.Popen(
            [str(a) for a in request["argv"]],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=str(request.get("cwd") or "/"),
            env=env,
            user=uid,
            group=gid,
            extra_groups=[],
            start_new_session=True,
            preexec_fn=_take_terminal if tty else None,
        )
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    process.returncode = 0  # reaped by the agent's own waitpid loop, never by Popen
    child = Child(process.pid, str(request.get("tag") or ""), bool(tty), marker)
    child.out, child.input = out, child_input
    for fd in (*out.values(), child_input):
        os.set_blocking(fd, False)
    return child


def signal_child(child: Child, signum: int) -> None:
    """To its process group, and to every process carrying its marker: what left its group
    (double forks, daemons) still has the marker in its environment."""
    if child.exit is None:  # ended, its pid may be another's now: only its marker says
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signum)
    if not child.marker:
        return
    wanted = f"{MARKER_VARIABLE}={child.marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if wanted in f.read(1 << 20).split(b"\0"):
                    os.kill(int(name), signum)
        except OSError:
            continue


def network_sockets() -> list[str]:
    """What in the machine its gVisor cannot save: network sockets (TCP, UDP) of any
    process, listed by the netstack in /proc/net."""
    found = []
    for name in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{name}") as table:
                rows = table.read(1 << 20).splitlines()[1:]
        except OSError:
            continue
        for row in rows[:16]:
            fields = row.split()
            if len(fields) > 3:
                found.append(f"a {name} socket at {_address(fields[1])}")
    return found


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _write_file(path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):  # the kernel's own directory: its alone
        os.makedirs(parent, mode=0o700)
        os.chown(parent, uid, gid)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, mode & 0o777)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode & 0o777)
        os.write(fd, data)
    finally:
        os.close(fd)


def _address(hex_address: str) -> str:
    """`0100007F:1F90` as /proc/net writes it, as `127.0.0.1:8080` (IPv4; else as it is)."""
    host, _, port = hex_address.partition(":")
    try:
        if len(host) == 8:
            host = ".".join(str(b) for b in reversed(bytes.fromhex(host)))
        return f"{host}:{int(port, 16)}"
    except ValueError:
        return hex_address


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
