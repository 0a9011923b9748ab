"""Forks Python kernels, modules already imported, into local sandboxes (a zygote).

Importing pandas and matplotlib costs a kernel ~0.4 s and ~65 MB of memory of its own. The
zygote imports them once, on the host; each kernel is forked from it, so the pages of those
modules stay shared (copy on write) between every kernel on the host, and a kernel starts with
them loaded. Nothing of a session is ever in the zygote: it imports modules and forks, no more,
never runs a session's code and never reads a kernel's request (its keeper does); a kernel's
secrets (its signing key, its connection file) come after the fork; its random streams are
reseeded there (`random` reseeds itself at a fork; numpy's global generator is reseeded here).
What a fork cannot renew is the same in every kernel forked from one zygote, and documented
(docs/security.md): the hash seed, and the layout of memory (where libraries, heap and stack
are: address randomisation is per exec).

It runs as root with the kernels' interpreter and environment: on the host beside the service
for local sandboxes; for Docker's, in a container of the sandboxes' own image in the host's PID
namespace (sandbox/backends/docker_zygote.py), so that what it imports is the image's. The
modules' import-time code runs as root, as the service's own does. It is told what to do over
one SOCK_SEQPACKET socket that only the service holds. Each request is a message naming its
descriptors: the sandbox's namespaces (opened from its init: a sandbox bwrap or the engine
started with a holder instead of a kernel), its root directory, the cgroup.procs files of its
cgroups (opened for writing by the service), the seccomp filter, the kernel's output pipe, a
control socket and a memfd of the kernel's JSON (its command line, environment, ids, limits).
For each, the zygote forks a *keeper*, which:

- says its pid on the control socket and reads the JSON;
- joins the sandbox's cgroups and sets the rlimits;
- in a sandbox with user namespaces (bwrap's): drops to the sandbox's host uid (as bwrap's
  caller does), enters the sandbox's outer user namespace, then its mount, PID, IPC, UTS,
  network and cgroup namespaces, and takes its root;
- in one without (a container's): enters those namespaces and takes the root as root, empties
  its bounding set, then drops to the sandbox's uid (every capability goes with root);
- forks the kernel (the first process the keeper makes in the sandbox's PID namespace), says
  the kernel's pid, drops every capability and waits for the kernel, then says how it ended.

The kernel enters the kernel's own (inner) user namespace if there is one, drops every
capability, sets no_new_privs and loads the seccomp filter (as the command server does:
`_confine`), takes a
session of its own, its output pipe as stdout and stderr, closes every other descriptor, takes
back what an interpreter starts with (the signals Python ignores or handles, dumpable), the
kernel's environment, working directory and PYTHONPATH and its maths libraries' threads, and
runs ipykernel's app with the kernel's own command line: the start-up files run as in any
kernel.

    python kernel_zygote.py FD              (FD: the socket; the modules come in the first message)
    python kernel_zygote.py --connect PATH  (the socket the service listens on, in a container)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
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

MESSAGE_LIMIT = 1 << 16  # the service's own messages; a kernel's request comes in a memfd
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
# setns flags of the namespaces entered after the outer user namespace, in this order.
NAMESPACES = (
    ("mnt", 0x00020000),
    ("pid", 0x20000000),
    ("ipc", 0x08000000),
    ("uts", 0x04000000),
    ("net", 0x40000000),
    ("cgroup", 0x02000000),
)
# A request's descriptors: it names them, in the order they come. The user namespaces come
# both or neither (a container has none of its own); a cgroup's cgroup.procs, once for each
# hierarchy the sandbox's init is in.
REQUIRED = frozenset(
    {*(name for name, _ in NAMESPACES), "root", "seccomp", "output", "control", "request"}
)
USER_NAMESPACES = frozenset({"outer_userns", "inner_userns"})
CGROUP_PROCS = "cgroup_procs"
MAX_CGROUPS = 16
MAX_DESCRIPTORS = len(REQUIRED) + len(USER_NAMESPACES) + MAX_CGROUPS


def _say(channel: socket.socket, message: dict[str, Any]) -> None:
    channel.send(json.dumps(message).encode())


def _keeper(libc: ctypes.CDLL, fds: dict[str, int], cgroups: list[int]) -> None:
    """In the forked keeper: never returns."""
    control = socket.socket(fileno=fds.pop("control"))
    try:
        _say(control, {"keeper": os.getpid()})
        request = json.loads(command_server._read_all(fds.pop("request")))
        for procs in cgroups:
            os.write(procs, b"0")  # this process: the kernel is forked into its groups
            os.close(procs)
        cgroups.clear()
        for which, value in request["rlimits"]:
            resource.setrlimit(which, (value, value))
        uid = int(request["uid"])
        groups = [int(g) for g in request.get("groups", [])]
        if "outer_userns" in fds:
            _become(uid, groups)  # every capability in the host's namespace goes
            _enter(libc, fds.pop("outer_userns"), command_server.CLONE_NEWUSER, "user")
            _enter_namespaces(libc, fds)
        else:  # no user namespace to enter: as root, then the sandbox's uid for good
            _enter_namespaces(libc, fds)
            _empty_bounding_set(libc)
            _become(uid, groups)
            _drop_capabilities(libc)  # the inheritable set too, which a uid change keeps
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
        reason = str(exc) or repr(exc)  # an OSError's names the file it could not use
        try:
            _say(control, {"error": reason})
        finally:
            os._exit(1)


def _become(uid: int, groups: list[int]) -> None:
    os.setgroups(groups)
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _enter_namespaces(libc: ctypes.CDLL, fds: dict[str, int]) -> None:
    """The sandbox's mount, PID, IPC, UTS, network and cgroup namespaces, then its root."""
    for name, flag in NAMESPACES:
        _enter(libc, fds.pop(name), flag, name)
    root = fds.pop("root")
    os.fchdir(root)
    os.chroot(".")
    os.close(root)


def _enter(libc: ctypes.CDLL, fd: int, flag: int, name: str) -> None:
    try:
        command_server._check(libc.setns(fd, flag), f"entering the sandbox's {name} namespace")
    finally:
        os.close(fd)


def _drop_bounding_set(libc: ctypes.CDLL) -> int:
    """Every capability out of the bounding set, up to the first that cannot go: the errno
    it failed with (EINVAL: past the last there is; EPERM: no right to drop any)."""
    cap = 0
    while libc.prctl(command_server.PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    return ctypes.get_errno()


def _empty_bounding_set(libc: ctypes.CDLL) -> None:
    """The bounding set emptied, which the kernel inherits (as a container with no
    capability has it), while there is still the right to."""
    if _drop_bounding_set(libc) != errno.EINVAL:
        command_server._check(-1, "emptying the bounding set")


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Every capability, from the bounding set (if any may still go) and then the keeper's own."""
    _drop_bounding_set(libc)
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
        if os.getppid() != 0:  # the keeper (outside this PID namespace: 0) died already
            os._exit(1)
        command_server._confine(
            libc, {"userns_fd": fds.pop("inner_userns", None), "seccomp_fd": fds.pop("seccomp")}
        )
        os.setsid()
        output = fds.pop("output")
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        # Up to the highest open now (a bound far above it costs a close() each where the
        # host has no close_range).
        os.closerange(3, max(map(int, os.listdir("/proc/self/fd"))) + 1)
        # Python's own, as in any interpreter that starts: errors, not deaths, for a broken pipe
        # and a file over its size limit; KeyboardInterrupt for an interrupt.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Dumpable, as a process that execs as its own user is (forked from root, it is not):
        # its /proc files readable by itself.
        command_server._check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
        os.chdir(str(request["workdir"]))
        env = {str(k): str(v) for k, v in request["env"].items()}
        # As `python -m ipykernel_launcher` leaves it: PYTHONPATH's entries first (an empty
        # one is the working directory), as an interpreter makes them as it starts (the
        # session's, not the zygote's); IPython adds "" before site-packages itself.
        extra = env.get("PYTHONPATH", "")
        sys.path[:1] = [os.path.abspath(entry) for entry in extra.split(":")] if extra else []
        os.environ.clear()
        os.environ.update(env)
        _threads(env)
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


def _threads(env: dict[str, str]) -> None:
    """The maths libraries' threads as the kernel's environment says (they read it as they
    load, in the zygote, which had one each)."""
    try:
        wanted = int(env.get("OPENBLAS_NUM_THREADS", "1"))
        if wanted > 1:
            from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

            threadpool_limits(limits=wanted)
    except Exception:
        return


def _serve(libc: ctypes.CDLL, connection: socket.socket) -> None:
    # Keepers end on their own; nothing here waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(connection, MESSAGE_LIMIT, MAX_DESCRIPTORS)
        except InterruptedError:
            continue
        if not data:
            return  # the service closed its end
        named, cgroups = _named(data, fds)
        if named is None:  # not a request the service makes: nothing is forked for it
            for fd in fds:
                os.close(fd)
            continue
        try:
            pid = os.fork()
        except OSError:
            pid = -1  # the control socket closes below: the service hears of no keeper
        if pid == 0:
            connection.close()
            _keeper(libc, named, cgroups)
        for fd in fds:
            os.close(fd)


def _named(data: bytes, fds: list[int]) -> tuple[dict[str, int] | None, list[int]]:
    """A request's descriptors by name, and its cgroup.procs files; None if the message does
    not name exactly what came, as the service would."""
    try:
        names = json.loads(data)["fork"]
    except (ValueError, KeyError, TypeError):
        return None, []
    if not isinstance(names, list) or len(names) != len(fds):
        return None, []
    named: dict[str, int] = {}
    cgroups: list[int] = []
    for name, fd in zip(names, fds, strict=True):
        if name == CGROUP_PROCS:
            cgroups.append(fd)
        elif name in REQUIRED | USER_NAMESPACES and name not in named:
            named[name] = fd
        else:
            return None, []
    users = USER_NAMESPACES & named.keys()
    if REQUIRED - named.keys() or users not in (set(), USER_NAMESPACES):
        return None, []
    if len(cgroups) > MAX_CGROUPS:
        return None, []
    return named, cgroups


def _warm_up() -> None:
    """Fill, once for every kernel, the caches a first chart fills in each (fonts found and
    loaded, glyphs, the PNG encoder; pandas' own lazy imports): drawn with matplotlib's
    renderer alone, never through pyplot, whose backend is the kernel's (inline) to choose."""
    if "pandas" in sys.modules:
        pandas = sys.modules["pandas"]
        frame = pandas.DataFrame({"x": [0, 1, 2], "y": [0, 1, 4]})
        frame.groupby("x")["y"].sum()
    if "matplotlib" not in sys.modules:
        return
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure()
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if "pandas" in sys.modules:  # pandas' plotting (pyplot takes its backend, the inline one:
        # the kernel's start-up file hooks it into the kernel's shell)
        sys.modules["pandas"].Series([0, 1, 4], name="y").plot(ax=axes, title="warm-up")
    else:
        axes.plot([0, 1, 2], [0, 1, 4], label="warm-up")
    axes.legend()
    figure.savefig(io.BytesIO(), format="png")
    if "e2b_charts" in sys.modules:  # the chart extractor's models, built once for all
        sys.modules["e2b_charts"].chart_figure_to_dict(figure)


def _connection(argv: list[str]) -> socket.socket:
    if argv[:1] == ["--connect"]:  # in a container: the service listens where it is bound
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(argv[1])
        return connection
    return socket.socket(fileno=int(argv[0]))


def _name_libraries_by_real_path() -> None:
    """Every shared library loaded, known to the loader by its real path too.

    A kernel forked into a container sees the image's files through another mount than the
    zygote's: the same path, another device. A library opened again by its real path there
    (threadpoolctl finds the maths libraries' so, to read and set their threads) would be
    matched by its device and inode, and missed. Opened here by that path, where they match,
    the loader adds the path to the library's names, which match anywhere."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return
    paths = {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}
    for path in sorted(p for p in paths if ".so" in os.path.basename(p)):
        with contextlib.suppress(OSError):
            ctypes.CDLL(os.path.realpath(path), mode=os.RTLD_NOLOAD)


def main() -> None:
    connection = _connection(sys.argv[1:])
    hello = json.loads(connection.recv(MESSAGE_LIMIT))
    failed: dict[str, str] = {}
    gc.disable()  # imports allocate much that lives for good: no collection meanwhile
    for name in hello["modules"]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):  # only ever warmer, never a reason not to fork
        _warm_up()
    _name_libraries_by_real_path()
    gc.enable()
    gc.collect()  # the warm-up's garbage goes before the rest is frozen for good
    gc.freeze()  # what the imports made is never touched by a kernel's collections
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        _say(connection, {"error": f"{threads} threads after the imports: a fork is unsafe"})
        return
    _say(connection, {"ready": os.getpid(), "failed": failed})
    _serve(ctypes.CDLL(None, use_errno=True), connection)


if __name__ == "__main__":
    main()
