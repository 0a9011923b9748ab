"""Turns a process that has just entered a local sandbox into the command it was asked to run.

The host's `nsenter` has put this process in the sandbox's outer user namespace and in its mount,
PID, IPC, UTS, network and cgroup namespaces, with the sandbox's root and working directory, and
runs it with the sandbox's own interpreter. What is left, done here in this order, is what bwrap
does for the kernel: tell the host our pid (handing it a pipe that our exec closes) and wait
until it has put us in our cgroup; enter the kernel's (inner) user namespace, where we are uid
1000; drop every capability from the bounding set; start a session of our own (so we lead the
group the host signals) and take the terminal as ours when there is one; restore the signals
Python ignores; close every other descriptor; set no_new_privs; load the sandbox's seccomp
filter; exec the command with exactly the environment asked for. A failure before the exec is
written to that pipe.

Standard library only, with -I -S: it runs inside the sandbox, beside code it must not trust.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import termios

CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
WORKSPACE = "/workspace"


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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


def _handshake(control: int) -> int:
    """Our pid in the sandbox to the host, with the read end of a pipe that only we hold (its
    write end closes at our exec: the host then knows all went well); then wait for its
    go-ahead (it moves us into our cgroup meanwhile, while nothing of ours has started yet).
    Returns the pipe's write end, where a failure is told."""
    report_read, report_write = os.pipe()  # both close on exec
    with socket.socket(fileno=os.dup(control)) as channel:
        message = json.dumps({"pid": os.getpid()}).encode() + b"\n"
        socket.send_fds(channel, [message], [report_read])
        os.close(report_read)
        if channel.recv(16) != b"go":
            os._exit(1)  # the host gave up on us
    os.close(control)
    return report_write


def _become(libc: ctypes.CDLL, spec: dict[str, object]) -> None:
    userns = int(str(spec["userns_fd"])) if spec.get("userns_fd") is not None else None
    if userns is not None:
        _check(libc.setns(userns, CLONE_NEWUSER), "entering the sandbox's user namespace")
        os.close(userns)
        cap = 0
        while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
            cap += 1
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the last capability there is
            _check(-1, "dropping capabilities")
    cwd = os.path.join(str(spec["workspace"]), str(spec.get("cwd") or ""))
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot use {cwd!r} as the working directory: {exc.strerror}"
        ) from None
    os.setsid()
    if spec.get("terminal"):
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_DFL)
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "setting the parent-death signal")


def _confine(libc: ctypes.CDLL, seccomp_fd: int | None) -> None:
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")
    if seccomp_fd is not None:
        program = _read_all(seccomp_fd)
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
        _check(
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
            "loading the seccomp filter",
        )


def main() -> None:
    spec = json.loads(_read_all(int(sys.argv[1])))
    report = _handshake(int(spec["control_fd"]))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _become(libc, spec)
        seccomp_fd = spec.get("seccomp_fd")
        keep = {0, 1, 2, report} | ({int(str(seccomp_fd))} if seccomp_fd is not None else set())
        for fd in range(3, max(keep) + 1):
            if fd not in keep:
                os.closerange(fd, fd + 1)
        os.closerange(max(keep) + 1, os.sysconf("SC_OPEN_MAX"))
        _confine(libc, int(str(seccomp_fd)) if seccomp_fd is not None else None)
        argv = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot run {argv[0]!r}: {exc.strerror}") from None
    except OSError as exc:
        os.write(report, json.dumps({"error": exc.strerror or str(exc)}).encode() + b"\n")
        os._exit(127)


if __name__ == "__main__":
    main()
