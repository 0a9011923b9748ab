"""Root for the sandbox's user in a gVisor machine: what `sudo` asks the agent for.

gVisor sets no_new_privs on every task it runs, so a setuid `sudo` can never gain rights in a
machine. Root there is gVisor's, not the host's (docs/gvisor.md), so the agent, which runs as
the machine's root, starts a command as root for any process of the machine that asks on its
socket (`SOCKET`, as `sudo` with NOPASSWD would): the asker passes its stdin, stdout and stderr
over the socket (SCM_RIGHTS) with one line of JSON (argv, cwd, environment); the command runs
on those very files, in a session of its own; the asker may send `signal N` lines (its Ctrl-C);
the agent answers `exit N` or `signal N` once it ends. An asker that goes away takes its
command's process group with it.

Every input is capped: the request's size, the descriptors taken (the three, no more), the
commands running at once. Standard library only, like the agent that imports it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

SOCKET = "/run/cir/root.sock"
# Present while the operator has root turned off (the host says so at each hello): sudo reads it
# to say why there is no socket.
TURNED_OFF = "/run/cir/root-off"
_SIGNAL_LINE = re.compile(rb"signal ([0-9]{1,2})")
MAX_REQUEST = 256 * 1024  # bytes of JSON: argv and environment
MAX_RUNNING = 32  # commands run as root at once
_FDS = 3


@dataclass
class Asker:
    """One connection: its request as it arrives, then its command."""

    conn: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    pid: int | None = None
    lines: bytearray = field(default_factory=bytearray)  # signal lines, after the request


class RootRequests:
    """The agent's side: the listening socket, the askers, their commands."""

    def __init__(self, unwatch: Callable[[int], None]) -> None:
        """`unwatch`: stop watching a connection's fd (called before it is closed)."""
        self._unwatch = unwatch
        self.listener: socket.socket | None = None
        self.askers: dict[int, Asker] = {}  # by connection fd
        self.by_pid: dict[int, Asker] = {}

    def listen(self) -> socket.socket:
        os.makedirs(os.path.dirname(SOCKET), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(SOCKET)
        os.chmod(SOCKET, 0o666)  # any process of the machine, as NOPASSWD sudo
        sock.listen(16)
        sock.setblocking(False)
        self.listener = sock
        with contextlib.suppress(FileNotFoundError):
            os.unlink(TURNED_OFF)
        return sock

    def stop_listening(self) -> None:
        """Root turned off: no new asker is taken (commands running as root go on to their end;
        a machine restored with root off had none running)."""
        if self.listener is not None:
            self._unwatch(self.listener.fileno())
            self.listener.close()
            self.listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET)
        with open(TURNED_OFF, "w"):
            pass

    def accept(self) -> socket.socket | None:
        if self.listener is None:
            return None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        if len(self.askers) >= MAX_RUNNING:
            _say(conn, f"refused: {MAX_RUNNING} commands run as root already\n")
            conn.close()
            return None
        conn.setblocking(False)
        self.askers[conn.fileno()] = Asker(conn)
        return conn

    def readable(self, fd: int) -> bool:
        """Read what an asker sent; False once it is done with (unwatched and closed)."""
        asker = self.askers[fd]
        try:
            data, fds = _receive(asker.conn)
        except BlockingIOError:
            return True
        except OSError:
            data, fds = b"", []
        for extra in fds[max(0, _FDS - len(asker.fds)) :]:
            os.close(extra)
        asker.fds += fds[: max(0, _FDS - len(asker.fds))]
        if not data:  # gone: its command (if any) goes too
            self._drop(asker, kill=True)
            return False
        if asker.pid is not None:
            return self._signals(asker, data)
        asker.buffer += data
        if b"\n" not in asker.buffer:
            if len(asker.buffer) > MAX_REQUEST:
                return self._refuse(asker, "the request is too large")
            return True
        line, _, rest = bytes(asker.buffer).partition(b"\n")
        asker.buffer.clear()
        try:
            self._start(asker, json.loads(line))
        except Exception as exc:  # said to the asker; the agent goes on
            return self._refuse(asker, f"{type(exc).__name__}: {exc}")
        return self._signals(asker, rest) if rest else True

    def _start(self, asker: Asker, request: dict[str, Any]) -> None:
        if len(asker.fds) != _FDS:
            raise ValueError("send stdin, stdout and stderr with the request")
        argv = [str(a) for a in request["argv"]]
        if not argv:
            raise ValueError("no command")
        env = {str(k): str(v) for k, v in dict(request.get("env") or {}).items()}
        env = root_environment(env, explicit={str(n) for n in request.get("assigned") or ()})
        process = subprocess.Popen(
            argv,
            stdin=asker.fds[0],
            stdout=asker.fds[1],
            stderr=asker.fds[2],
            cwd=str(request.get("cwd") or "/"),
            env=env,
            start_new_session=True,
        )
        for fd in asker.fds:
            os.close(fd)
        asker.fds.clear()
        asker.pid = process.pid
        self.by_pid[process.pid] = asker
        process.returncode = 0  # reaped by the agent's loop, not by Popen

    def _signals(self, asker: Asker, data: bytes) -> bool:
        asker.lines += data[: 4096 - len(asker.lines)]
        while b"\n" in asker.lines:
            line, _, rest = bytes(asker.lines).partition(b"\n")
            asker.lines = bytearray(rest)
            found = _SIGNAL_LINE.fullmatch(line)
            number = int(found[1]) if found else 0
            if 0 < number < signal.NSIG and asker.pid is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.killpg(asker.pid, number)
        if len(asker.lines) >= 4096:
            asker.lines.clear()
        return True

    def reaped(self, pid: int, status: int) -> bool:
        """A child ended: whether it was an asker's (told how, and forgotten)."""
        asker = self.by_pid.pop(pid, None)
        if asker is None:
            return False
        if os.WIFSIGNALED(status):
            _say(asker.conn, f"signal {os.WTERMSIG(status)}\n")
        else:
            _say(asker.conn, f"exit {os.WEXITSTATUS(status)}\n")
        self._drop(asker, kill=False)
        return True

    def drop_fd(self, fd: int) -> None:
        """Drop the asker of this connection (its command killed), if it is one."""
        asker = self.askers.get(fd)
        if asker is not None:
            self._drop(asker, kill=True)

    def _refuse(self, asker: Asker, why: str) -> bool:
        _say(asker.conn, f"refused: {why}\n")
        self._drop(asker, kill=False)
        return False

    def _drop(self, asker: Asker, *, kill: bool) -> None:
        if kill and asker.pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(asker.pid, signal.SIGKILL)
        for fd in asker.fds:
            os.close(fd)
        asker.fds.clear()
        if asker.pid is not None:
            self.by_pid.pop(asker.pid, None)
        fd = asker.conn.fileno()
        if self.askers.pop(fd, None) is not None:
            self._unwatch(fd)
        asker.conn.close()


def root_environment(env: dict[str, str], explicit: Collection[str] = ()) -> dict[str, str]:
    """The caller's environment for a command as root: root's home and name, a PATH with the
    system's sbin directories (dpkg wants them), and nothing of the user's installs in the
    workspace: root's `pip install` and `npm i -g` go to the image's own places (a root-owned
    file in the workspace would refuse the user's next install), and root runs no command and
    imports no module the user installed there. `explicit`: variables the caller set for this
    command alone (`sudo NAME=VALUE ...`), kept as given."""
    kept = {k: v for k, v in env.items() if k not in USER_INSTALLS or k in explicit}
    for name in ("PATH", "PYTHONPATH"):
        if name in kept and name not in explicit:
            kept[name] = ":".join(
                p for p in kept[name].split(":") if p and not p.startswith(USER_PREFIX)
            )
    if not kept.get("PYTHONPATH"):
        kept.pop("PYTHONPATH", None)
    if "PATH" not in explicit:
        parts = [p for p in (kept.get("PATH") or "/usr/local/bin:/usr/bin:/bin").split(":") if p]
        kept["PATH"] = ":".join([*parts, *(d for d in _SBIN if d not in parts)])
    return {**kept, "HOME": "/root", "USER": "root", "LOGNAME": "root"}


_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# sandbox/install_places.py's, named again here (this runs inside, standard library only).
USER_PREFIX = "/home/user/.local"
USER_INSTALLS = ("PIP_TARGET", "NPM_CONFIG_PREFIX")  # the variables pointing installs there


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(_FDS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _say(conn: socket.socket, text: str) -> None:
    with contextlib.suppress(OSError):
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(text.encode())
