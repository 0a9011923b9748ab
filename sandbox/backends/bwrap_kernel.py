"""A kernel started under bubblewrap: the launcher the local backend's driver starts each
kernel with, its options (namespaces, mounts, seccomp, the kernel's environment handed over in
memory), and the kernel process it watches.

bwrap runs by the absolute path the backend found once, with an empty environment of its own;
the kernel's environment and every option are handed over in memory (`--args FD`), so nothing a
session sets chooses what the host runs or shows in the host's process list. The kernel's own
stdout and stderr go to a pipe the host drains (stdio_tail.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import proc_view, seccomp
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX
from sandbox.cgroup_oom import OomClock
from sandbox.cgroups import SandboxCgroup
from sandbox.egress_channel import (
    EGRESS_DIR_IN_SANDBOX,
    FORWARDER_FILE,
    FORWARDER_IN_SANDBOX,
    EgressChannel,
    proxy_environment,
    with_forwarder,
)
from sandbox.host_channel import HOST_TOOLS_DIR_IN_SANDBOX, HOST_TOOLS_ENV, HostChannel
from sandbox.host_commands import memfd_with
from sandbox.install_places import USER_BINS_IN_SANDBOX
from sandbox.kernel.command import KERNEL_START_FILES, kernel_environment
from sandbox.kernel.connection import KERNEL_DIR_IN_SANDBOX
from sandbox.kernel.process import KernelExit
from sandbox.kernel.programs import (
    COMMAND_SERVER_FILE,
    COMMAND_SERVER_IN_SANDBOX,
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    KernelPrograms,
    language_environment,
)
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.state_dir import SessionDirs

# System files the kernel may read; everything else under /etc stays out of sight.
_ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "hosts",
    "mime.types",
    "fonts",
    "alternatives",
    "ssl/certs",
    "ca-certificates",
    "os-release",
    "debian_version",
    "protocols",
    "services",
    "matplotlibrc",
    "R",  # R's Renviron, Rprofile.site, ldpaths: R_HOME/etc links here
)
# Java reads its configuration through links into /etc/java-<version>-openjdk.
_ETC_PATTERNS = ("java-*-openjdk",)
_SANDBOX_UID = 1000  # the uid and gid the code sees
_SHM_SIZE_MB = 64  # as Docker's default /dev/shm
# How long bwrap may take to exit once its PID namespace's init is killed (every process of
# the namespace exits first, freeing its memory) before it is killed itself.
INIT_EXIT_WAIT_S = 5.0


@dataclass(frozen=True)
class HostPrograms:
    """What the launcher executes, resolved once by the backend."""

    python: str
    bwrap: str
    kernels: KernelPrograms


class BwrapKernel:
    """A kernel running under bwrap. bwrap exits with its child's status (128+N for signal N)."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        cgroup: SandboxCgroup | None,
        group: Path | None = None,
        oom_clock: OomClock | None = None,
        *,
        init_first: bool = False,
        output: asyncio.StreamReader | None = None,
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        # `proc` is bwrap with a PID namespace of its own (not the unsafe mode's bare kernel).
        self.init_first = init_first
        # Python's kernel waits for the group to empty before its successor starts; another
        # language's shares the group with Python's, which is never empty while it runs.
        self.group = group
        self.oom_kills = cgroup.oom_kills() if cgroup else 0
        self.oom_clock = oom_clock
        stream = output if output is not None else proc.stdout
        assert stream is not None
        self.output = StdioTail(stream)

    async def _returncode(self) -> int:
        return await self.proc.wait()

    async def wait(self) -> KernelExit:
        code = await self._returncode()
        died = time.monotonic()
        await self.output.settle()  # its last words, for diagnostics()
        # Without a memory cgroup nothing here can tell a kill for memory from another one.
        oom = None if self.cgroup is None else self._ran_out_of_memory(died)
        return KernelExit.from_returncode(code, out_of_memory=oom)

    def _ran_out_of_memory(self, died: float) -> bool:
        """Whether the sandbox's cgroup counted an OOM kill since this kernel started and,
        where Linux says when (`OomClock`), ran out of memory just before `died`: the kernel
        shares the cgroup with commands, whose own OOM kills count there too."""
        assert self.cgroup is not None
        counted = self.cgroup.oom_kills() > self.oom_kills
        if self.oom_clock is None:
            return counted
        return counted and self.oom_clock.ran_out_shortly_before(died)

    async def kill(self) -> None:
        # The sandbox's init (bwrap's child, pid 1 of its PID namespace) goes first: its death
        # kills every process the code started, and bwrap, still alive, reaps it and exits.
        # Killed first, bwrap would orphan it (--die-with-parent kills it then): its zombie
        # would hold the sandbox's pids count until the host's init reaped it, a second or more
        # later (or never, with this service as a container's pid 1).
        if self.proc.returncode is None:
            if self.init_first and kill_namespace_init(self.proc.pid, self.group):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.proc.wait(), INIT_EXIT_WAIT_S)
            if self.proc.returncode is None:  # no init found, or bwrap did not exit: kill it
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
        await self.proc.wait()
        self.output.stop()
        if self.cgroup is not None:  # the next kernel shares the limits: its leftovers go first
            await self.cgroup.wait_empty(group=self.group)

    def diagnostics(self) -> str:
        return self.output.text()


class BwrapLauncher:
    def __init__(
        self,
        unsafe: bool,
        programs: HostPrograms,
        spec: SandboxSpec,
        dirs: SessionDirs,
        host_uid: int | None,
        python_roots: list[str],
        cgroup: SandboxCgroup | None,
        channel: HostChannel | None = None,
        language: str = PYTHON,
        egress: EgressChannel | None = None,
        oom_clock: OomClock | None = None,
    ) -> None:
        self.unsafe = unsafe  # unsafe_no_sandbox: a plain host process, no bwrap
        self.egress = egress
        self.oom_clock = oom_clock
        self.language = language
        self.programs = programs
        self.spec = spec
        self.dirs = dirs
        self.host_uid = host_uid
        self.python_roots = python_roots
        self.cgroup = cgroup
        self.channel = channel
        self.kernel: BwrapKernel | None = None  # the one running now

    def sandbox_pid(self) -> int | None:
        """The host pid of the running kernel's bwrap, which processes join; None if none."""
        kernel = self.kernel
        if kernel is None or kernel.proc.returncode is not None:
            return None
        return kernel.proc.pid

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The kernel's environment (the session's variables included) with `extra` on top; the
        host tools variable comes last, so no caller's variables can move it."""
        python = self.programs.python
        # Last, the workspace's commands (`npm i -g`); not for a kernel with no sandbox, where
        # that path is the host's own.
        user_bin = [] if self.unsafe else list(USER_BINS_IN_SANDBOX)
        first = [str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        path = ":".join(dict.fromkeys([*first, *user_bin]))
        variables = {**self.spec.env, **(extra or {})}
        if self.egress is not None:  # first: the session's own variables may change them
            variables = {**proxy_environment(), **variables}
        if self.channel is not None:
            where = self.channel.path if self.unsafe else HOST_TOOLS_DIR_IN_SANDBOX
            variables[HOST_TOOLS_ENV] = str(where)
        home = str(self.dirs.root / "home") if self.unsafe else "/tmp"
        variables = {**language_environment(self.language), **variables}
        return kernel_environment(path=path, home=home, limits=self.spec.limits, extra=variables)

    def process_environment(self, request_env: dict[str, str]) -> dict[str, str]:
        return self.environment(request_env)

    @property
    def kernel_dir(self) -> Path:
        return self.dirs.kernel_of(self.language)

    @property
    def kernel_dir_in_sandbox(self) -> str:
        return str(self.kernel_dir) if self.unsafe else KERNEL_DIR_IN_SANDBOX

    @property
    def kernel_uid(self) -> int | None:
        return self.host_uid

    async def launch(self, connection_file_in_sandbox: str) -> BwrapKernel:
        limits = self.spec.limits
        pids_group = self.cgroup.kernel_group(self.language) if self.cgroup else None
        fds: list[int] = []
        try:
            if self.unsafe:
                (self.dirs.root / "home").mkdir(exist_ok=True)
                # No sandbox: the kernel is a host process with this environment. The
                # interpreter's path is absolute, so the session's PATH cannot choose it.
                env = self.environment()
                argv = self._kernel_command(connection_file_in_sandbox)
                cwd = str(self.dirs.workspace)
            else:
                argv = self.bwrap_argv(
                    self.environment(), fds, self._kernel_command(connection_file_in_sandbox)
                )
                env = {}  # bwrap's own (the sandbox's pid 1): nothing of the session or host
                cwd = "/"
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                preexec_fn=confine(limits, self.cgroup, self.host_uid, pids_group),
                start_new_session=True,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.kernel = BwrapKernel(
            proc,
            self.cgroup,
            group=pids_group,
            oom_clock=self.oom_clock,
            init_first=not self.unsafe,
        )
        return self.kernel

    def bwrap_argv(self, env: dict[str, str], fds: list[int], command: list[str]) -> list[str]:
        """bwrap running `command` in the sandbox with `env`, its options in a memfd (put in
        `fds`, which the caller passes and closes)."""
        options = self._bwrap_args(env, fds)
        if any("\0" in option for option in options):  # each NUL ends an argument
            raise SandboxStartError("an environment variable holds a NUL character")
        fds.append(memfd_with("bwrap-args", b"".join(o.encode() + b"\0" for o in options)))
        return [self.programs.bwrap, "--args", str(fds[-1]), *command]

    def _kernel_command(self, connection_file: str) -> list[str]:
        command = self.programs.kernels.command(
            self.language, connection_file, self.kernel_dir_in_sandbox, self.spec.limits
        )
        if self.egress is not None and not self.unsafe:
            return with_forwarder(self.programs.kernels.python, command)
        return command

    def _bwrap_args(self, env: dict[str, str], fds: list[int]) -> list[str]:
        """bwrap's options; the data they name (seccomp filter, /proc files) is put in `fds`."""
        limits = self.spec.limits
        flags = [
            "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox",
        ]  # fmt: skip
        # Order matters: a later mount covers an earlier one. /tmp comes before the binds, so a
        # Python that lives under /tmp (a checkout there) stays visible.
        mounts: list[tuple[str, ...]] = [
            ("--ro-bind", "/usr", "/usr"),
            ("--proc", "/proc"),
            ("--dev", "/dev"),
            ("--perms", "1777", "--size", str(_SHM_SIZE_MB << 20), "--tmpfs", "/dev/shm"),
            ("--size", str(limits.tmp_size_mb << 20), "--tmpfs", "/tmp"),
        ]
        for name, data in proc_view.synthetic_files(limits).items():
            fds.append(memfd_with(Path(name).name, data))
            mounts.append(("--ro-bind-data", str(fds[-1]), name))
        for name in proc_view.masked_present():
            mounts.append(("--ro-bind", "/dev/null", name))  # nodev there: it cannot be opened
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                mounts.append(("--symlink", os.readlink(host), str(host)))
            elif host.is_dir():
                mounts.append(("--ro-bind", str(host), str(host)))
        for name in _ETC_FILES:
            host = Path("/etc") / name
            if host.exists():
                mounts.append(("--ro-bind", str(host), str(host)))
        for pattern in _ETC_PATTERNS:
            for host in sorted(Path("/etc").glob(pattern)):
                mounts.append(("--ro-bind", str(host), str(host)))
        for name in ("passwd", "group"):
            mounts.append(("--ro-bind", str(self.dirs.etc / name), f"/etc/{name}"))
        for root in self.python_roots:
            mounts.append(("--ro-bind", root, root))
        mounts += [
            *(("--ro-bind", str(host), inside) for host, inside in KERNEL_START_FILES),
            ("--ro-bind", str(COMMAND_SERVER_FILE), COMMAND_SERVER_IN_SANDBOX),
            ("--ro-bind", str(SUPERVISOR_FILE), SUPERVISOR_IN_SANDBOX),
            ("--ro-bind", str(FORWARDER_FILE), FORWARDER_IN_SANDBOX),
            ("--bind", str(self.dirs.workspace), WORKSPACE_IN_SANDBOX),
            ("--bind", str(self.kernel_dir), KERNEL_DIR_IN_SANDBOX),
        ]
        if self.channel is not None:
            mounts.append(("--ro-bind", str(self.channel.path), HOST_TOOLS_DIR_IN_SANDBOX))
        if self.egress is not None:
            mounts.append(("--ro-bind", str(self.egress.path), EGRESS_DIR_IN_SANDBOX))
        mounts += [
            ("--bind", str(self.dirs.workspace), HOME_IN_SANDBOX),
            *(
                ("--ro-bind" if m.read_only else "--bind", m.source, m.path)
                for m in self.spec.mounts  # after the workspace: one may be inside it
            ),
            ("--remount-ro", "/"),  # bwrap's root is a tmpfs: nothing may be created there
            ("--chdir", self.spec.workdir),
        ]
        # The kernel's environment, applied inside only.
        environment = ["--clearenv"]
        for name, value in env.items():
            environment += ["--setenv", name, value]
        fds.append(memfd_with("seccomp", seccomp.bpf_program()))
        return [
            *flags,
            *(arg for mount in mounts for arg in mount),
            *environment,
            "--seccomp",
            str(fds[-1]),
        ]


def kill_namespace_init(bwrap_pid: int, group: Path | None) -> bool:
    """SIGKILL the init of bwrap's PID namespace (bwrap's one child); say whether it was found.
    The child is pinned by a pidfd, then checked to be bwrap's child, pid 1 of a namespace of
    its own, and (with cgroups) in the kernel's group: a pid reused meanwhile is never hit."""
    try:
        children = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children").read_text().split()
    except OSError:  # gone already, or no such file on this kernel: bwrap is killed instead
        return False
    found = False
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            pidfd = os.pidfd_open(int(child))
            try:
                if _is_namespace_init(int(child), bwrap_pid, group):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    found = True
            finally:
                os.close(pidfd)
    return found


def _is_namespace_init(pid: int, parent: int, group: Path | None) -> bool:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    nspids = status.get("NSpid", "").split()
    if int(status.get("PPid", "0")) != parent or len(nspids) < 2 or nspids[-1] != "1":
        return False
    if group is None:
        return True
    # The group's own list, not /proc/<pid>/cgroup: that names paths as the reader's cgroup
    # namespace sees them (inside a container on v1: under /docker/<id>/), which never match.
    return str(pid) in (group / "cgroup.procs").read_text().split()


def rlimits(
    limits: ResourceLimits, cgroup: SandboxCgroup | None, host_uid: int | None
) -> list[tuple[int, int]]:
    """The rlimits a sandbox's processes run under (`confine`)."""
    values = [
        (resource.RLIMIT_FSIZE, limits.file_size_mb << 20),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ]
    if cgroup is None:
        # No aggregate limit: bound each process's private memory instead. (RLIMIT_AS would
        # count address space, several times what a Python process really uses.)
        values.append((resource.RLIMIT_DATA, limits.memory_mb << 20))
        if host_uid is not None:  # counted per host uid: meaningful when the uid is ours alone
            values.append((resource.RLIMIT_NPROC, limits.pids))
    return values


def confine(
    limits: ResourceLimits,
    cgroup: SandboxCgroup | None,
    host_uid: int | None,
    pids_group: Path | None = None,
) -> Callable[[], None]:
    """What the child does between fork and exec, in this order: join the cgroup (which needs
    root), set the rlimits, then drop to the sandbox's own host uid."""
    values = rlimits(limits, cgroup, host_uid)

    def apply() -> None:
        if cgroup is not None:
            cgroup.join_self(pids_group)
        for which, value in values:
            resource.setrlimit(which, (value, value))
        if host_uid is not None:
            os.setgroups([])
            os.setgid(host_uid)
            os.setuid(host_uid)

    return apply
