"""The embedded default backend: a kernel under bubblewrap on this machine, no daemon needed.

Each sandbox gets its own user, PID, IPC, UTS, mount, cgroup and network namespaces (so only
`lo`), a read-only view of the system, one writable workspace, a size-capped private /tmp, a
non-root uid with no capabilities, no nested user namespaces, a seccomp filter (sandbox/seccomp.py),
a size-capped /dev/shm, a /proc that shows nothing host-wide (sandbox/proc_view.py), rlimits, and an
environment that holds none of the host's variables. When the orchestrator runs as root, each
sandbox also runs under a host uid of its own, so that even outside the namespaces it is nobody.

How a kernel starts under bwrap: bwrap_kernel.py. What the kernel's interpreter is on this
host: local_probe.py. Processes beside the kernel (commands, background processes, terminals)
join the running kernel's sandbox through `nsenter`, with the kernel's uid, namespaces, seccomp
filter, cgroup, rlimits and environment: see local_processes.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, Field

from code_interpreter_wire.errors import BackendUnavailable, ProcessesUnsupported
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import SandboxSpec
from sandbox import cgroups
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.bwrap_kernel import BwrapLauncher, HostPrograms, confine
from sandbox.backends.forked_kernel import ForkingLauncher, zygote_environment
from sandbox.backends.kernel_recipe import ChannelPeer, KernelRecipe
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.backends.kernel_zygote import KernelZygote
from sandbox.backends.local_command_server import LocalProcessSettings
from sandbox.backends.local_probe import PythonProbe, absolute_python, probe_python
from sandbox.backends.local_processes import NSENTER_HINT, LocalSpawner
from sandbox.cgroup_oom import OomClock
from sandbox.cgroups import SandboxCgroup
from sandbox.host_commands import resolve
from sandbox.kernel.command import STARTUP_FILE, STARTUP_FILE_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.programs import (
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    KernelPrograms,
    host_programs,
)
from sandbox.processes.spawned import Spawner
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


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the local backend (sandbox/backends/registry.py): bubblewrap."""
    return None if shutil.which("bwrap") else "bwrap is not installed"


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
    zygote_modules: list[str] = Field(
        default_factory=list,
        description="Modules a kernel zygote imports once (on the host, as root: the service "
        "must run as root): Python's kernels are then forked from it into their sandboxes, "
        "those modules loaded and their memory shared between every kernel (docs/security.md). "
        "Empty: each kernel is started afresh.",
    )
    cpu_weight_per_sandbox: bool = Field(
        default=True,
        description="With cgroups: weigh the sandboxes' parent group as one process per live "
        "sandbox among the host's others (cpu.shares 1024 each), so a busy host does not "
        "squeeze every session into one process's share (at most one per core); off, the "
        "parent's weight is left as it is.",
    )


class LocalBackend(Backend):
    name = "local"
    capabilities = BackendCapabilities(
        network_modes=("none", "allow_list", "any"),
        host_tools=True,
        processes=True,
        suspend=False,  # no CRIU here: pausing saves the kernel's state instead
        snapshot=True,
        shared_across_nodes=False,
        images=False,  # the host's own interpreters, bound read-only
        runtimes=False,
        warm_pool=True,
        labels_sandboxes=False,  # its sandboxes are its state dir's: nobody else's are there
        host_dirs=True,
        ports=True,
        mounts=True,
        egress_files=True,
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(LocalBackendConfig(**config))

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self.config = config or LocalBackendConfig()
        self.uids = HostUidPool(self.config.host_uid_base, self.config.host_uid_count)
        self._probed: PythonProbe | None = None
        # Found once, here: what runs on the host never depends on a PATH.
        self._python = absolute_python(self.config.python)
        try:
            self._bwrap: str | None = resolve(self.config.bwrap)
        except BackendUnavailable:
            self._bwrap = None  # told at create(); the unsafe mode does without
        try:
            self._nsenter: str | None = resolve(self.config.nsenter)
        except BackendUnavailable:
            self._nsenter = None  # told when a process is asked for; kernels do without
        self._zygote: KernelZygote | None = None
        if self.config.zygote_modules and not self.config.unsafe_no_sandbox:
            if os.geteuid() == 0:
                home = Path(tempfile.mkdtemp(prefix="cir-zygote-"))  # root's alone (0700)
                self._zygote = KernelZygote(
                    self._python,
                    list(self.config.zygote_modules),
                    zygote_environment(self._python, home),
                    home,
                )
            else:  # it enters each sandbox as that sandbox's own uid, which needs root
                log.warning("zygote_modules is ignored: forking kernels into sandboxes needs root")

    async def create(self, spec: SandboxSpec | None = None) -> LocalSandbox:
        spec = spec or SandboxSpec()
        self.refuse_runtime(spec)
        if not self.config.unsafe_no_sandbox and self._bwrap is None:
            raise BackendUnavailable(INSTALL_HINT)
        if self.config.unsafe_no_sandbox:
            if spec.mounts:
                raise BackendUnavailable(
                    "mounts (volumes) need a sandbox to mount them in; unsafe_no_sandbox has none"
                )
            log.warning("UNSAFE: running a kernel with no sandbox (unsafe_no_sandbox is set)")
        probe = await self._probe()
        programs = HostPrograms(self._python, self._bwrap or "", self._kernel_programs(probe))
        return await _LocalRecipe(self, spec, programs, probe.roots, self._zygote).make()

    async def close(self) -> None:
        if self._zygote is not None:
            await self._zygote.close()

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        return self._kernel_programs(await self._probe()).languages

    def _kernel_programs(self, probe: PythonProbe) -> KernelPrograms:
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
        # the groups of exactly those sandboxes, if any were made
        await asyncio.to_thread(cgroups.remove_groups_of, removed)
        return len(removed)

    def spawner_for(self, launcher: BwrapLauncher) -> Spawner:
        """How processes join the sandbox whose Python kernel `launcher` started."""
        unsafe = self.config.unsafe_no_sandbox
        if not unsafe and self._nsenter is None:
            raise ProcessesUnsupported(NSENTER_HINT)
        settings = LocalProcessSettings(
            python=self._python,
            nsenter=None if unsafe else self._nsenter,
            workspace=launcher.dirs.workspace,
            cgroup=launcher.cgroup,
            preexec=confine(launcher.spec.limits, launcher.cgroup, launcher.host_uid),
        )
        return LocalSpawner(settings, launcher.sandbox_pid, launcher.process_environment)

    def allocate_uid(self) -> int | None:
        """A host uid of the sandbox's own, as root (None: it runs as this process's)."""
        if os.geteuid() != 0 or self.config.unsafe_no_sandbox:
            return None
        return self.uids.allocate()

    def release(self, host_uid: int | None, cgroup: SandboxCgroup | None) -> None:
        """Give back what a sandbox held once it is gone: its cgroup, then its uid."""
        if cgroup is not None:
            cgroup.remove()
        if host_uid is not None:
            self.uids.release(host_uid)

    async def _probe(self) -> PythonProbe:
        if self._probed is None:
            self._probed = await probe_python(
                self._python,
                configured=self.config.python,
                state_dir=self.config.state_dir,
                sandboxed_as_others=os.geteuid() == 0 and not self.config.unsafe_no_sandbox,
            )
        return self._probed


class _LocalRecipe(KernelRecipe["LocalSandbox"]):
    """A local sandbox's steps of the recipe (kernel_recipe.py): a host uid of its own (as
    root), a cgroup (as root on cgroup v1), and bwrap."""

    def __init__(
        self,
        backend: LocalBackend,
        spec: SandboxSpec,
        programs: HostPrograms,
        python_roots: list[str],
        zygote: KernelZygote | None = None,
    ) -> None:
        super().__init__(spec)
        self.zygote = zygote
        self.backend = backend
        self.config = backend.config
        self.programs = programs
        self.python_roots = python_roots
        self.host_uid: int | None = None
        self.dirs: SessionDirs | None = None
        self.cgroup: SandboxCgroup | None = None
        self.oom_clock: OomClock | None = None
        self.python_launcher: BwrapLauncher | None = None  # processes join its sandbox

    @property
    def owner(self) -> tuple[int, int] | None:
        return (self.host_uid, self.host_uid) if self.host_uid is not None else None

    async def make_dirs(self) -> SessionDirs:
        self.host_uid = self.backend.allocate_uid()
        unsafe = self.config.unsafe_no_sandbox
        self.dirs = await asyncio.to_thread(  # mounts: subprocesses, off the event loop
            SessionDirs.create,
            self.config.state_dir,
            self.backend.name,
            self.sandbox_id,
            workspace_size_mb=None if unsafe else self.spec.limits.workspace_size_mb,
            owner=self.owner,
        )
        return self.dirs

    async def prepare(self, dirs: SessionDirs) -> None:
        cfg = self.config
        if cfg.use_cgroups and not cfg.unsafe_no_sandbox and cgroups.available():
            self.cgroup = SandboxCgroup(self.sandbox_id, scale_parent=cfg.cpu_weight_per_sandbox)
            self.cgroup.create(self.spec.limits)
            self.oom_clock = OomClock.open(self.cgroup.memory)

    def channel_peer(self) -> ChannelPeer:
        # The kernel's uid (and gid) as the host sees them.
        peer = self.host_uid if self.host_uid is not None else os.geteuid()
        return ChannelPeer(peer, peer)

    def wants_egress(self) -> bool:
        # With no sandbox the kernel is on the host's own network: nothing to channel.
        return super().wants_egress() and not self.config.unsafe_no_sandbox

    def launcher(self, language: str) -> BwrapLauncher:
        assert self.dirs is not None
        launcher = (BwrapLauncher if self.zygote is None else ForkingLauncher)(
            self.config.unsafe_no_sandbox,
            self.programs,
            self.spec,
            self.dirs,
            self.host_uid,
            self.python_roots,
            self.cgroup,
            self.host_channel,
            language,
            self.egress_channel,
            self.oom_clock,
        )
        if isinstance(launcher, ForkingLauncher):
            assert self.zygote is not None
            launcher.zygote = self.zygote
        if language == PYTHON:
            self.python_launcher = launcher
        return launcher

    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> LocalSandbox:
        launcher = self.python_launcher
        assert launcher is not None
        host_uid, cgroup = self.host_uid, self.cgroup
        return LocalSandbox(
            self.sandbox_id,
            self.spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace), owner=self.owner),
            on_close=lambda: self.backend.release(host_uid, cgroup),  # from a worker thread
            oom_clock=self.oom_clock,
            make_spawner=lambda: self.backend.spawner_for(launcher),
            languages=self.programs.kernels.languages,
            make_driver=self.driver,
            cpu_group=cgroup,
        )

    async def undo(self) -> None:
        if self.oom_clock is not None:  # before its cgroup goes (which would signal it)
            self.oom_clock.close()
        await asyncio.to_thread(self.backend.release, self.host_uid, self.cgroup)


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
        cpu_group: SandboxCgroup | None = None,
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._on_close = on_close
        self._make_spawner = make_spawner
        self._oom_clock = oom_clock
        self._cpu_group = cpu_group

    def weigh_cpu(self, *, background: bool) -> None:
        if self._cpu_group is not None:  # cgroup writes, quick enough to make on the loop
            self._cpu_group.weigh(background=background)

    def spawner(self) -> Spawner:
        """Processes join the running kernel's sandbox; a kernel restart ends them."""
        return self._make_spawner()

    async def _teardown(self) -> None:
        await super()._teardown()
        if self._oom_clock is not None:  # before its cgroup goes (which would signal it)
            self._oom_clock.close()
        await asyncio.to_thread(self._on_close)
