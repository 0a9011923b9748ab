"""Runs a sandbox's commands from inside it: entered and confined once, it forks each.

Entering a sandbox per command (util-linux `nsenter` and a fresh interpreter, or an engine's
exec) cost ~30-40 ms of an `echo hi`. This server is entered once.

In a Docker container (runc), an exec starts it as the sandbox's uid (the container confines it
as it does the kernel: capabilities, seccomp profile, limits) and it connects to a socket the
host listens on in the kernel's directory; a command's signals go through it too (`_signal`).

On the local backend, the host's `nsenter` has put it in the
sandbox's outer user namespace and its mount, PID, IPC, UTS, network and cgroup namespaces, with
the sandbox's root, under the sandbox's own interpreter. Here it does, once, what bwrap does for
the kernel: enter the kernel's (inner) user namespace, where it is uid 1000; drop every
capability from the bounding set and then its own; set no_new_privs; load the sandbox's seccomp
filter. Its children inherit all of it.

The host holds the other end of its one connection, a SOCK_SEQPACKET socket (locally a
socketpair: nothing in the sandbox can reach it; in a container, the host checks its peer is
the exec it started). Each message from the host is a command (its id, with five
descriptors: its stdin, stdout, stderr, a control socket, and a memfd of its JSON, which may be
large) or a request to kill one whose start it gave up; the server forks a child for a command,
which says its pid on the control socket with a pipe its exec closes, waits for the host's
go-ahead (the host puts it in its own cgroup meanwhile), then takes its working directory, a
session of its own (and the terminal, when it has one), the signals Python ignores back, closes
every other descriptor, and execs the command with exactly the environment asked for; a failure
before the exec is written to that pipe. The server reaps its children and tells the host each one's
status, by the command's id. It exits when the host closes the connection; its children live on
(a command that kills everything its uid may, `kill -9 -1`, kills the server too, and runs on),
and the host follows each to its end by a pidfd.

Standard library only, with -I -S: it runs inside the sandbox, beside code it must not trust.

    python -I -S command_server.py FD   (FD: a memfd with the JSON the host sends first)
    python -I -S command_server.py --connect SOCKET WORKSPACE   (in a container, by an exec)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
import termios
from typing import Any

CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MESSAGE_LIMIT = 1 << 20  # a command's JSON (its argv and environment) from the host
FDS_PER_COMMAND = 5  # stdin, stdout, stderr, control, the command's JSON (a memfd)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _confine(libc: ctypes.CDLL, spec: dict[str, Any]) -> None:
    """Become what the kernel is, for good: its user namespace, no capabilities at all (bounding,
    effective, permitted), no_new_privs, its seccomp filter."""
    userns = spec.get("userns_fd")
    if userns is not None:
        _check(libc.setns(int(str(userns)), CLONE_NEWUSER), "entering the sandbox's user namespace")
        os.close(int(str(userns)))
        cap = 0
        while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
            cap += 1
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the last capability there is
            _check(-1, "dropping capabilities")
        header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
        none = (_CapData * 2)()
        _check(libc.capset(ctypes.byref(header), none), "dropping capabilities")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")
    seccomp_fd = spec.get("seccomp_fd")
    if seccomp_fd is not None:
        program = _read_all(int(str(seccomp_fd)))
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
        _check(
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
            "loading the seccomp filter",
        )


def _handshake(control: int) -> int:
    """Our pid in the sandbox to the host, with the read end of a pipe that only we hold (its
    write end closes at our exec: the host then knows all went well); then wait for its
    go-ahead (it moves us into our cgroup meanwhile, while nothing of ours has started yet).
    Returns the pipe's write end, where a failure is told."""
    report_read, report_write = os.pipe()  # both close on exec
    with socket.socket(fileno=control) as channel:
        message = json.dumps({"pid": os.getpid()}).encode() + b"\n"
        socket.send_fds(channel, [message], [report_read])
        os.close(report_read)
        if channel.recv(16) != b"go":
            os._exit(1)  # the host gave up on us
    return report_write


def _become_the_command(libc: ctypes.CDLL, spec: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: never returns."""
    stdin, stdout, stderr, control = fds
    report = -1
    try:
        report = _handshake(control)
        cwd = os.path.join(str(spec["workspace"]), str(spec.get("cwd") or ""))
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot use {cwd!r} as the working directory: {exc.strerror}"
            ) from None
        os.setsid()
        for target, fd in enumerate((stdin, stdout, stderr)):
            os.dup2(fd, target)
        if spec.get("terminal"):
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.closerange(3, report)
        os.closerange(report + 1, os.sysconf("SC_OPEN_MAX"))
        argv = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
        if spec.get("inherit_env"):  # a container's: the server's own, as an exec's would be
            env = {**os.environ, **env}
        for name, value in (spec.get("default_env") or {}).items():
            env.setdefault(str(name), str(value))
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot run {argv[0]!r}: {exc.strerror}") from None
    except BaseException as exc:  # a child must never return into the server
        if report >= 0:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            os.write(report, json.dumps({"error": reason or repr(exc)}).encode() + b"\n")
        os._exit(127)


class Server:
    def __init__(self, libc: ctypes.CDLL, connection: socket.socket, workspace: str) -> None:
        self.libc = libc
        self.connection = connection
        self.workspace = workspace
        self.children: dict[int, int] = {}  # pid -> the host's id of its command
        self.wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.connection, selectors.EVENT_READ)
        selector.register(self.wake_read, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is self.connection and not self._take_command():
                    return
            self._reap()

    def _take_command(self) -> bool:
        """One message from the host; False once it has closed the connection."""
        try:
            message, fds, _, _ = socket.recv_fds(self.connection, MESSAGE_LIMIT, FDS_PER_COMMAND)
        except InterruptedError:
            return True
        if not message:
            return False
        told = json.loads(message)
        if "kill" in told:
            self._kill(int(told["kill"]))
        elif "signal" in told:
            self._signal(int(told["signal"]), int(told["signum"]), str(told["marker"]))
        elif len(fds) == FDS_PER_COMMAND:
            spec = json.loads(_read_all(fds.pop()))  # read and closed: four are left
            self._fork(int(told["id"]), fds, spec)
        for fd in fds:  # the command's (its child has them now), or a message's that was cut
            os.close(fd)
        return True

    def _fork(self, command: int, fds: list[int], spec: dict[str, Any]) -> None:
        spec["workspace"] = self.workspace
        server = os.getpid()
        slave = None
        try:
            if spec.get("terminal"):
                # Made here, in the sandbox's own devpts: the command's terminal has a name
                # there (`tty`, `ttyname`). The host gets its master first, on the control.
                master, slave = os.openpty()
                try:
                    with socket.socket(fileno=os.dup(fds[3])) as control:
                        socket.send_fds(control, [b'{"terminal": true}\n'], [master])
                finally:
                    os.close(master)
                fds = [slave, slave, slave, fds[3]]
            pid = os.fork()
        except OSError as exc:
            # The sandbox's process limit, most likely: the host reads why on the control (if
            # it still listens: it may have given up on this start).
            reason = f"it could not be started: {exc.strerror}"
            told = {"error": reason, "errno": exc.errno}
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fds[3])) as control:
                control.send(json.dumps(told).encode() + b"\n")
            return
        finally:
            if slave is not None and os.getpid() == server:
                os.close(slave)
        if pid == 0:
            self.connection.close()
            os.close(self.wake_read)
            signal.set_wakeup_fd(-1)
            _become_the_command(self.libc, spec, fds)
        self.children[pid] = command

    def _kill(self, command: int) -> None:
        """A command whose start the host gave up: it and its group, if it made one."""
        for pid, its_command in self.children.items():
            if its_command == command:
                for kill in (os.killpg, os.kill):
                    with contextlib.suppress(OSError):
                        kill(pid, signal.SIGKILL)

    def _signal(self, command: int, signum: int, marker: str) -> None:
        """A command's group while it runs (once reaped, its number may be another's), then
        every process whose environment holds its marker: what it started, even what left the
        group. Only what this uid may signal, so never anything outside the sandbox."""
        for pid, its_command in self.children.items():
            if its_command == command:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signum)
        entry = marker.encode()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            with contextlib.suppress(OSError), open(f"/proc/{name}/environ", "rb") as environ:
                if entry in environ.read().split(b"\0"):
                    os.kill(int(name), signum)

    def _reap(self) -> None:
        try:
            while os.read(self.wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            command = self.children.pop(pid, None)
            if command is not None:
                code = os.waitstatus_to_exitcode(status)
                self.connection.send(json.dumps({"exited": command, "code": code}).encode())


def main() -> None:
    if sys.argv[1] == "--connect":  # a container: Docker confined it; reach the host's socket
        spec = {"workspace": sys.argv[3]}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(sys.argv[2])
    else:
        spec = json.loads(_read_all(int(sys.argv[1])))
        connection = socket.socket(fileno=int(spec["connection_fd"]))
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if "connection_fd" in spec:  # locally: it ends with its nsenter, the host's
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "the parent-death signal")
        # Not in a container: its parent there is a thread of the engine's shim (a Go program,
        # whose threads may end while it lives on), and the signal comes at that thread's end.
        # It ends when the host closes the connection, or with its container.
        _confine(libc, spec)
        # Nothing else it was given stays open (nsenter's user namespace, say).
        os.closerange(3, connection.fileno())
        os.closerange(connection.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
    except OSError as exc:
        connection.send(json.dumps({"error": exc.strerror or str(exc)}).encode())
        sys.exit(1)
    connection.send(json.dumps({"pid": os.getpid()}).encode())
    Server(libc, connection, str(spec["workspace"])).serve()


if __name__ == "__main__":
    main()
