"""The embedded default backend: a kernel under bubblewrap on this machine, no daemon needed.

Each sandbox gets its own user, PID, IPC, UTS, mount, cgroup and network namespaces (so only
`lo`), a read-only view of the system, one writable workspace, a size-capped private /tmp, a
non-root uid with no capabilities, no nested user namespaces, a seccomp filter (sandbox/seccomp.py),
a size-capped /dev/shm, a /proc that shows nothing host-wide (sandbox/proc_view.py), rlimits, and an
environment that holds none of the host's variables. When the orchestrator runs as root, each
sandbox also runs under a host uid of its own, so that even outside the namespaces it is nobody.

How the host starts it: bwrap by the absolute path found once at construction, with an empty
environment of its own; the kernel's environment and every option are handed over in memory
(`--args FD`), so nothing a session sets chooses what the host runs or shows in the host's
process list. The kernel's own stdout and stderr go to a pipe the host drains (stdio_tail.py).

Processes beside the kernel (commands, background processes, terminals) join the running
kernel's sandbox through `nsenter`, with the kernel's uid, namespaces, seccomp filter, cgroup,
rlimits and environment: see local_processes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from sandbox import cgroups, proc_view, seccomp
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX, Backend
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.backends.local_processes import (
    LAUNCHER_FILE,
    LAUNCHER_IN_SANDBOX,
    NSENTER_HINT,
    LocalProcessSettings,
    LocalSpawner,
)
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
from sandbox.errors import BackendUnavailable, ProcessesUnsupported, SandboxStartError
from sandbox.host_channel import HOST_TOOLS_DIR_IN_SANDBOX, HOST_TOOLS_ENV, HostChannel
from sandbox.host_commands import HOST_ENVIRONMENT, memfd_with, resolve
from sandbox.kernel.command import STARTUP_FILE, STARTUP_FILE_IN_SANDBOX, kernel_environment
from sandbox.kernel.connection import KERNEL_DIR_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.process import KernelExit
from sandbox.kernel.programs import (
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    KernelPrograms,
    host_programs,
    language_environment,
)
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.languages import PYTHON
from sandbox.processes.spawned import Spawner
from sandbox.socket_peer import SocketPeer
from sandbox.spec import ResourceLimits, SandboxSpec
from sandbox.state_dir import SessionDirs, default_state_dir
from sandbox.uids import HostUidPool
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "bubblewrap (bwrap) is required by the local sandbox and was not found. Install it with "
    "`apt-get install bubblewrap` as root (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora). "
    "If, and only if, you trust the code completely, the loudly named option "
    "`unsafe_no_sandbox` (CLI: --unsafe-no-sandbox) runs kernels with no isolation at all."
)
# An install without the `kernel` extra has no ipykernel: say which extra, not "No module named".
KERNEL_MISSING_HINT = (
    "the kernel interpreter {python!r} has no ipykernel, which the local sandbox runs. Install "
    "the kernel extra into it: `pip install 'code-interpreter-runtime[kernel]'` (or set the "
    "local backend's `python` to an interpreter that has it)."
)
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


class LocalBackendConfig(BaseModel):
    state_dir: Path = Field(default_factory=default_state_dir)
    python: str = Field(
        default=sys.executable,
        description="Interpreter that runs the kernel; it needs ipykernel and the data libraries.",
    )
    bwrap: str = Field(
        default="bwrap",
        description="bubblewrap: an absolute path, or a name looked up once in the system's own "
        "directories (never in PATH).",
    )
    nsenter: str = Field(
        default="nsenter",
        description="util-linux nsenter, which starts processes inside a running sandbox: an "
        "absolute path, or a name looked up once in the system's own directories.",
    )
    unsafe_no_sandbox: bool = Field(
        default=False,
        description="Run kernels with NO isolation: the code can do anything you can. Never "
        "for untrusted code.",
    )
    host_uid_base: int = Field(
        default=1_500_000,
        description="As root, sandbox i runs as host uid host_uid_base + i (never a real user).",
    )
    host_uid_count: int = 10_000
    use_cgroups: bool = Field(
        default=True,
        description="As root on cgroup v1, limit each sandbox's memory, processes and CPU in a "
        "cgroup of its own (otherwise: per-process rlimits only).",
    )


class LocalBackend(Backend):
    name = "local"

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self.config = config or LocalBackendConfig()
        self.uids = HostUidPool(self.config.host_uid_base, self.config.host_uid_count)
        self._probed: _PythonProbe | None = None
        # Found once, here: what runs on the host never depends on a PATH.
        self._python = _absolute_python(self.config.python)
        try:
            self._bwrap: str | None = resolve(self.config.bwrap)
        except BackendUnavailable:
            self._bwrap = None  # told at create(); the unsafe mode does without
        try:
            self._nsenter: str | None = resolve(self.config.nsenter)
        except BackendUnavailable:
            self._nsenter = None  # told when a process is asked for; kernels do without

    async def create(self, spec: SandboxSpec | None = None) -> LocalSandbox:
        spec = spec or SandboxSpec()
        self.refuse_runtime(spec)
        cfg = self.config
        if not cfg.unsafe_no_sandbox and self._bwrap is None:
            raise BackendUnavailable(INSTALL_HINT)
        if cfg.unsafe_no_sandbox:
            log.warning("UNSAFE: running a kernel with no sandbox (unsafe_no_sandbox is set)")
        sandbox_id = secrets.token_hex(8)
        host_uid = self._allocate_uid()
        owner = (host_uid, host_uid) if host_uid is not None else None
        try:
            dirs = await asyncio.to_thread(  # mounts: subprocesses, off the event loop
                SessionDirs.create,
                cfg.state_dir,
                self.name,
                sandbox_id,
                workspace_size_mb=None if cfg.unsafe_no_sandbox else spec.limits.workspace_size_mb,
                owner=owner,
            )
        except BaseException:
            self._release_uid(host_uid)
            raise
        cgroup = None
        oom_clock = None
        try:
            channel = None
            if spec.host_tools:  # the kernel's uid (and gid) as the host sees them
                peer = host_uid if host_uid is not None else os.geteuid()
                channel = HostChannel.create(dirs.host_tools, peer_uid=peer, peer_gid=peer)
            egress = None
            if spec.network.enabled and not cfg.unsafe_no_sandbox:  # unsafe: the host's network
                peer = host_uid if host_uid is not None else os.geteuid()
                egress = EgressChannel.create(dirs.egress, peer=SocketPeer(peer), peer_gid=peer)
            if cfg.use_cgroups and not cfg.unsafe_no_sandbox and cgroups.available():
                cgroup = SandboxCgroup(sandbox_id)
                cgroup.create(spec.limits)
                oom_clock = OomClock.open(cgroup.memory)
            probe = await self._probe()
            kernels = self._kernel_programs(probe)

            def launcher_of(language: str) -> _BwrapLauncher:
                return _BwrapLauncher(
                    cfg,
                    _HostPrograms(self._python, self._bwrap or "", kernels),
                    spec,
                    dirs,
                    host_uid,
                    probe.roots,
                    cgroup,
                    channel,
                    language,
                    egress,
                    oom_clock,
                )

            launcher = launcher_of(PYTHON)
            driver = KernelDriver.for_spec(launcher, spec)
            await driver.start()
        except BaseException:
            await asyncio.to_thread(dirs.remove)
            if oom_clock is not None:
                oom_clock.close()
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
            self._release_uid(host_uid)
            raise
        sandbox = LocalSandbox(
            sandbox_id,
            spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace), owner=owner),
            on_close=lambda: self._closed(host_uid, cgroup),  # called from a worker thread
            oom_clock=oom_clock,
            make_spawner=lambda: self._spawner(launcher),
            languages=kernels.languages,
            make_driver=lambda language: KernelDriver.for_spec(
                launcher_of(language), spec, language
            ),
        )
        sandbox.host_channel = channel
        sandbox.egress_channel = egress
        return sandbox

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        return self._kernel_programs(await self._probe()).languages

    def _kernel_programs(self, probe: _PythonProbe) -> KernelPrograms:
        """This host's kernels, by the paths a sandbox sees them at."""
        unsafe = self.config.unsafe_no_sandbox
        return host_programs(
            self._python,
            probe.prefix,
            probe.has_bash_kernel,
            startup_file=str(STARTUP_FILE) if unsafe else STARTUP_FILE_IN_SANDBOX,
            supervisor=str(SUPERVISOR_FILE) if unsafe else SUPERVISOR_IN_SANDBOX,
        )

    async def cleanup_orphans(self) -> int:
        removed = SessionDirs.remove_orphans(self.config.state_dir, self.name)
        if cgroups.available():  # the groups of exactly those sandboxes, if any were made
            for sandbox_id in removed:
                await asyncio.to_thread(SandboxCgroup(sandbox_id).remove, 0.5)
        return len(removed)

    def _spawner(self, launcher: _BwrapLauncher) -> Spawner:
        unsafe = self.config.unsafe_no_sandbox
        if not unsafe and self._nsenter is None:
            raise ProcessesUnsupported(NSENTER_HINT)
        settings = LocalProcessSettings(
            python=self._python,
            nsenter=None if unsafe else self._nsenter,
            workspace=launcher.dirs.workspace,
            cgroup=launcher.cgroup,
            preexec=_confine(launcher.spec.limits, launcher.cgroup, launcher.host_uid),
        )
        return LocalSpawner(settings, launcher.sandbox_pid, launcher.process_environment)

    def _closed(self, host_uid: int | None, cgroup: SandboxCgroup | None) -> None:
        if cgroup is not None:
            cgroup.remove()
        self._release_uid(host_uid)

    def _allocate_uid(self) -> int | None:
        if os.geteuid() != 0 or self.config.unsafe_no_sandbox:
            return None
        return self.uids.allocate()

    def _release_uid(self, uid: int | None) -> None:
        if uid is not None:
            self.uids.release(uid)

    async def _probe(self) -> _PythonProbe:
        """What the kernel's interpreter is: the directories it needs that /usr does not
        already give, where its environment is, and whether it has the Bash kernel."""
        if self._probed is None:
            proc = await asyncio.create_subprocess_exec(
                self._python,
                "-c",
                "import sys, json, importlib.util as u; print(json.dumps([[sys.prefix, "
                "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], "
                "u.find_spec('ipykernel_launcher') is not None, "
                "u.find_spec('bash_kernel') is not None]))",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=HOST_ENVIRONMENT,
            )
            out, err = await proc.communicate()
            if proc.returncode != 0:
                raise BackendUnavailable(
                    f"the kernel interpreter {self.config.python!r} does not run: {err.decode()}"
                )
            prefixes, has_kernel, has_bash_kernel = json.loads(out)
            if not has_kernel:
                raise BackendUnavailable(KERNEL_MISSING_HINT.format(python=self.config.python))
            roots = _outside_usr(prefixes)
            if os.geteuid() == 0 and not self.config.unsafe_no_sandbox:
                for root in roots:
                    _check_reachable_by_others(root, "the kernel's Python")
                _check_reachable_by_others(str(self.config.state_dir.parent), "the state dir")
            self._probed = _PythonProbe(roots, prefixes[0], has_bash_kernel)
        return self._probed


def _absolute_python(python: str) -> str:
    """The kernel's interpreter as an absolute path (a bare name is looked up in the system's
    directories), so that no PATH, the unsafe mode's included, ever chooses it."""
    return python if os.path.isabs(python) else resolve(python)


@dataclass(frozen=True)
class _HostPrograms:
    """What the launcher executes, resolved once by the backend."""

    python: str
    bwrap: str
    kernels: KernelPrograms


@dataclass(frozen=True)
class _PythonProbe:
    roots: list[str]
    prefix: str
    has_bash_kernel: bool


def _outside_usr(prefixes: list[str]) -> list[str]:
    """The prefixes (and where their symlinks lead) that binding /usr does not cover."""
    roots: list[str] = []
    for prefix in prefixes:
        for p in (prefix, os.path.realpath(prefix)):
            if p != "/usr" and not p.startswith("/usr/") and p not in roots:
                roots.append(p)
    return roots


def _check_reachable_by_others(path: str, what: str) -> None:
    """As root, sandboxes run as other uids: what they use must be reachable by anyone."""
    current = Path(path)
    for part in [current, *current.parents]:
        mode = part.stat().st_mode
        if not mode & 0o001:
            raise BackendUnavailable(
                f"{what} lives under {part}, which other users cannot enter "
                f"(mode {oct(mode & 0o777)}), and sandboxes run as an unprivileged uid. For "
                "the Python, create the environment from a system Python (e.g. "
                "`/usr/bin/python3 -m venv .venv`, as `make install` does); for the state "
                "dir, choose one under /tmp or /var/lib."
            )


class LocalSandbox(KernelSandbox):
    backend = "local"

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
        on_close: Callable[[], None],
        make_spawner: Callable[[], Spawner],
        languages: list[str] | None = None,
        make_driver: Callable[[str], KernelDriver] | None = None,
        oom_clock: OomClock | None = None,
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._on_close = on_close
        self._make_spawner = make_spawner
        self._oom_clock = oom_clock

    def spawner(self) -> Spawner:
        """Processes join the running kernel's sandbox; a kernel restart ends them."""
        return self._make_spawner()

    async def _teardown(self) -> None:
        await super()._teardown()
        if self._oom_clock is not None:  # before its cgroup goes (which would signal it)
            self._oom_clock.close()
        await asyncio.to_thread(self._on_close)


class _BwrapKernel:
    """A kernel running under bwrap. bwrap exits with its child's status (128+N for signal N)."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        cgroup: SandboxCgroup | None,
        group: Path | None = None,
        oom_clock: OomClock | None = None,
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        # Python's kernel waits for the group to empty before its successor starts; another
        # language's shares the group with Python's, which is never empty while it runs.
        self.group = group
        self.oom_kills = cgroup.oom_kills() if cgroup else 0
        self.oom_clock = oom_clock
        assert proc.stdout is not None
        self.output = StdioTail(proc.stdout)

    async def wait(self) -> KernelExit:
        code = await self.proc.wait()
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
        # The sandbox's init dies with bwrap (--die-with-parent), taking its PID namespace,
        # and so every process the code started, with it.
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
        self.output.stop()
        if self.cgroup is not None:  # the next kernel shares the limits: its leftovers go first
            await self.cgroup.wait_empty(group=self.group)

    def diagnostics(self) -> str:
        return self.output.text()


class _BwrapLauncher:
    def __init__(
        self,
        config: LocalBackendConfig,
        programs: _HostPrograms,
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
        self.config = config
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
        self.kernel: _BwrapKernel | None = None  # the one running now

    def sandbox_pid(self) -> int | None:
        """The host pid of the running kernel's bwrap, which processes join; None if none."""
        kernel = self.kernel
        if kernel is None or kernel.proc.returncode is not None:
            return None
        return kernel.proc.pid

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The kernel's environment (the session's variables included) with `extra` on top; the
        host tools variable comes last, so no caller's variables can move it."""
        cfg, python = self.config, self.programs.python
        path = ":".join(
            dict.fromkeys([str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"])
        )
        variables = {**self.spec.env, **(extra or {})}
        if self.egress is not None:  # first: the session's own variables may change them
            variables = {**proxy_environment(), **variables}
        if self.channel is not None:
            where = self.channel.path if cfg.unsafe_no_sandbox else HOST_TOOLS_DIR_IN_SANDBOX
            variables[HOST_TOOLS_ENV] = str(where)
        home = str(self.dirs.root / "home") if cfg.unsafe_no_sandbox else "/tmp"
        variables = {**language_environment(self.language), **variables}
        return kernel_environment(path=path, home=home, limits=self.spec.limits, extra=variables)

    def process_environment(self, request_env: dict[str, str]) -> dict[str, str]:
        return self.environment(request_env)

    @property
    def kernel_dir(self) -> Path:
        return self.dirs.kernel_of(self.language)

    @property
    def kernel_dir_in_sandbox(self) -> str:
        return str(self.kernel_dir) if self.config.unsafe_no_sandbox else KERNEL_DIR_IN_SANDBOX

    @property
    def kernel_uid(self) -> int | None:
        return self.host_uid

    async def launch(self, connection_file_in_sandbox: str) -> _BwrapKernel:
        cfg, limits = self.config, self.spec.limits
        pids_group = self.cgroup.kernel_group(self.language) if self.cgroup else None
        fds: list[int] = []
        try:
            if cfg.unsafe_no_sandbox:
                (self.dirs.root / "home").mkdir(exist_ok=True)
                # No sandbox: the kernel is a host process with this environment. The
                # interpreter's path is absolute, so the session's PATH cannot choose it.
                env = self.environment()
                argv = self._kernel_command(connection_file_in_sandbox)
                cwd = str(self.dirs.workspace)
            else:
                options = self._bwrap_args(self.environment(), fds)
                if any("\0" in option for option in options):  # each NUL ends an argument
                    raise SandboxStartError("an environment variable holds a NUL character")
                fds.append(memfd_with("bwrap-args", b"".join(o.encode() + b"\0" for o in options)))
                argv = [
                    self.programs.bwrap,
                    "--args",
                    str(fds[-1]),
                    *self._kernel_command(connection_file_in_sandbox),
                ]
                env = {}  # bwrap's own (the sandbox's pid 1): nothing of the session or host
                cwd = "/"
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                preexec_fn=_confine(limits, self.cgroup, self.host_uid, pids_group),
                start_new_session=True,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.kernel = _BwrapKernel(proc, self.cgroup, group=pids_group, oom_clock=self.oom_clock)
        return self.kernel

    def _kernel_command(self, connection_file: str) -> list[str]:
        command = self.programs.kernels.command(
            self.language, connection_file, self.kernel_dir_in_sandbox, self.spec.limits
        )
        if self.egress is not None and not self.config.unsafe_no_sandbox:
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
            ("--ro-bind", str(STARTUP_FILE), STARTUP_FILE_IN_SANDBOX),
            ("--ro-bind", str(LAUNCHER_FILE), LAUNCHER_IN_SANDBOX),
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


def _confine(
    limits: ResourceLimits,
    cgroup: SandboxCgroup | None,
    host_uid: int | None,
    pids_group: Path | None = None,
) -> Callable[[], None]:
    """What the child does between fork and exec, in this order: join the cgroup (which needs
    root), set the rlimits, then drop to the sandbox's own host uid."""
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
