"""Forks Python kernels, modules already imported, into local sandboxes (a zygote).

Importing pandas and matplotlib costs a kernel ~0.4 s and ~65 MB of memory of its own. The
zygote imports them once, on the host; each kernel is forked from it, so the pages of those
modules stay shared (copy on write) between every kernel on the host, and a kernel starts with
them loaded. Nothing of a session is ever in the zygote: it imports modules and forks, no more,
and never runs a session's code; a kernel's secrets (its signing key, its connection file) come
after the fork; its random streams are reseeded there (`random` reseeds itself at a fork;
numpy's global generator is reseeded here). The hash seed is the zygote's, the same in every
kernel forked from it (it keys no secret of ours).

It runs as root, beside the service, with the kernels' interpreter and environment, and is
told what to do over one SOCK_SEQPACKET socket that only the service holds. Each request is a
JSON message with descriptors: the sandbox's namespaces (opened from its init, a sandbox bwrap
started with a holder instead of a kernel), its root directory, the seccomp filter, the kernel's
output pipe and a control socket. For each, the zygote forks a *keeper*, which:

- says its pid on the control socket;
- joins the sandbox's cgroups, sets the rlimits, drops to the sandbox's host uid (as bwrap's
  caller does), enters the sandbox's outer user namespace, then its mount, PID, IPC, UTS,
  network and cgroup namespaces, and takes its root;
- forks the kernel (the first process the keeper makes in the sandbox's PID namespace), says
  the kernel's pid, drops every capability and waits for the kernel, then says how it ended.

The kernel enters the kernel's own (inner) user namespace, drops every capability, sets
no_new_privs and loads the seccomp filter (as the command server does: `_confine`), takes a
session of its own, its output pipe as stdout and stderr, the kernel's environment and working
directory, closes every other descriptor, and runs ipykernel's app with the kernel's own
command line: the start-up files run as in any kernel.

    python kernel_zygote.py FD   (FD: the socket; the modules come in the first message)
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import resource
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported on the host: by its service end, by the tests
    from sandbox.inside_kernel import command_server
else:  # run as a script: its directory is first on sys.path
    import command_server  # the confinement every process in a sandbox takes

MESSAGE_LIMIT = 1 << 20
NS_GET_USERNS = 0xB701
PR_SET_PDEATHSIG = 1
# setns flags of the namespaces entered after the outer user namespace, in this order.
NAMESPACES = (
    ("mnt", 0x00020000),
    ("pid", 0x20000000),
    ("ipc", 0x08000000),
    ("uts", 0x04000000),
    ("net", 0x40000000),
    ("cgroup", 0x02000000),
)
# A request's descriptors, in this order.
DESCRIPTORS = (
    "outer_userns",
    "inner_userns",
    *(name for name, _ in NAMESPACES),
    "root",
    "seccomp",
    "output",
    "control",
)


def _say(channel: socket.socket, message: dict[str, Any]) -> None:
    channel.send(json.dumps(message).encode())


def _keeper(libc: ctypes.CDLL, request: dict[str, Any], fds: dict[str, int]) -> None:
    """In the forked keeper: never returns."""
    control = socket.socket(fileno=fds.pop("control"))
    try:
        _say(control, {"keeper": os.getpid()})
        for procs in request["cgroup_procs"]:
            with open(procs, "w") as group:
                group.write("0")
        for which, value in request["rlimits"]:
            resource.setrlimit(which, (value, value))
        uid = int(request["uid"])
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # every capability in the host's namespace goes
        command_server._check(
            libc.setns(fds.pop("outer_userns"), command_server.CLONE_NEWUSER),
            "entering the sandbox's user namespace",
        )
        for name, flag in NAMESPACES:
            command_server._check(libc.setns(fds.pop(name), flag), f"entering its {name} namespace")
        root = fds.pop("root")
        os.fchdir(root)
        os.chroot(".")
        os.close(root)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        kernel = os.fork()
        if kernel == 0:
            _kernel(libc, request, fds, control)
        for fd in fds.values():
            os.close(fd)
        # Nothing more to enter: the keeper keeps no capability in the sandbox's namespaces.
        _drop_capabilities(libc)
        command_server._check(libc.prctl(command_server.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "nnp")
        _say(control, {"kernel": kernel})
        _, status = os.waitpid(kernel, 0)
        _say(control, {"status": status})
        os._exit(0)
    except BaseException as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        try:
            _say(control, {"error": reason or repr(exc)})
        finally:
            os._exit(1)


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Every capability, from the bounding set and then the keeper's own."""
    cap = 0
    while libc.prctl(command_server.PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    header = command_server._CapHeader(command_server._LINUX_CAPABILITY_VERSION_3, 0)
    none = (command_server._CapData * 2)()
    command_server._check(libc.capset(ctypes.byref(header), none), "dropping capabilities")


def _kernel(
    libc: ctypes.CDLL, request: dict[str, Any], fds: dict[str, int], control: socket.socket
) -> None:
    """In the forked kernel: never returns."""
    try:
        control.close()
        command_server._check(
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "the parent-death signal"
        )
        command_server._confine(
            libc, {"userns_fd": fds.pop("inner_userns"), "seccomp_fd": fds.pop("seccomp")}
        )
        os.setsid()
        output = fds.pop("output")
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.chdir(str(request["workdir"]))
        sys.path[0] = ""  # as `python -m`: the working directory, not the zygote's
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        # Imported with no IPython shell there, the inline backend never hooked into one (it
        # does so on import): imported again by the kernel, it hooks into the kernel's.
        sys.modules.pop("matplotlib_inline.backend_inline", None)
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # the zygote's stream must not be every kernel's
            numpy.random.seed()
        argv = [str(a) for a in request["argv"]]
        sys.argv = ["ipykernel_launcher", *argv]
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        from ipykernel.kernelapp import IPKernelApp

        IPKernelApp.launch_instance(argv=argv)
    except BaseException as exc:  # a kernel must never return into the keeper
        os.write(2, f"the kernel did not start: {exc!r}\n".encode())
    os._exit(1)


def _serve(libc: ctypes.CDLL, connection: socket.socket) -> None:
    # Keepers end on their own; nothing here waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(connection, MESSAGE_LIMIT, len(DESCRIPTORS))
        except InterruptedError:
            continue
        if not data:
            return  # the service closed its end
        if len(fds) != len(DESCRIPTORS):
            for fd in fds:
                os.close(fd)
            continue
        named = dict(zip(DESCRIPTORS, fds, strict=True))
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            connection.close()
            _keeper(libc, json.loads(data), named)
        for fd in fds:
            os.close(fd)


def main() -> None:
    connection = socket.socket(fileno=int(sys.argv[1]))
    hello = json.loads(connection.recv(MESSAGE_LIMIT))
    failed: dict[str, str] = {}
    gc.disable()  # imports allocate much that lives for good: no collection meanwhile
    for name in hello["modules"]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    gc.enable()
    gc.freeze()  # what the imports made is never touched by a kernel's collections
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        _say(connection, {"error": f"{threads} threads after the imports: a fork is unsafe"})
        return
    _say(connection, {"ready": os.getpid(), "failed": failed})
    _serve(ctypes.CDLL(None, use_errno=True), connection)


if __name__ == "__main__":
    main()
