"""The production backend: one hardened container per kernel, on a real Docker engine.

Each sandbox runs as a host uid of its own (per-uid kernel quotas are not shared between
sessions), its containers under the options docker_launcher.py gives them. The workspace is a
host directory bound in (a size-capped tmpfs when the orchestrator is root), so files outlive
the container: replacing a dead or stuck kernel is replacing its container, and the session's
files stay. Deaths are learnt from the engine's event stream, not by polling
(docker_container.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import docker
from docker.errors import DockerException, ImageNotFound
from pydantic import BaseModel, Field

from code_interpreter_wire.errors import BackendUnavailable, RuntimeUnavailable
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import SandboxSpec
from sandbox import cgroups
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.docker_command_server import DockerServedSpawner
from sandbox.backends.docker_container import (
    LABEL_ORCHESTRATOR,
    LABEL_OWNER,
    DeathWatch,
    remove_container,
)
from sandbox.backends.docker_forked_kernel import ForkingContainerLauncher
from sandbox.backends.docker_launcher import (
    ContainerLauncher,
    gvisor_host_pids,
    write_user_database,
)
from sandbox.backends.docker_processes import DockerSpawner
from sandbox.backends.docker_zygote import DockerZygote
from sandbox.backends.kernel_recipe import ChannelPeer, KernelRecipe
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.image_labels import (
    IMAGE_PATH,
    KERNEL_IMAGE,
    TEMPLATE_LABEL,
    named_template,
    template_name_of,
)
from sandbox.kernel.command import STARTUP_FILE_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.programs import KernelPrograms, image_programs, refuse_unbuilt_template
from sandbox.process_identity import OwnerState, ProcessIdentity
from sandbox.processes.spawned import Spawner
from sandbox.state_dir import SessionDirs, default_state_dir
from sandbox.uids import HostUidPool
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

DEFAULT_IMAGE = KERNEL_IMAGE
GVISOR_PROGRAM = "runsc"  # a runtime whose program this is runs sandboxes under gVisor
# Who the host sees at the other end of a host socket a gVisor sandbox connects to (uid and
# program): its gofer, which runs as root (runsc --host-uds), not the sandbox's uid.
GVISOR_SOCKET_PEER = (0, "runsc-gofer")
ENGINE_HINT = (
    "Start a Docker engine (`sudo systemctl start docker`, or on a machine without systemd "
    "`sudo dockerd --bridge=none --iptables=false --ip-masq=false &`) or point DOCKER_HOST at one."
)


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the docker backend (sandbox/backends/registry.py): an
    engine, or the kernel image on it."""
    try:
        with contextlib.closing(docker.from_env()) as client:
            client.ping()
            client.images.get(DEFAULT_IMAGE)
    except ImageNotFound:
        return f"the image {DEFAULT_IMAGE} is missing: run `make image`"
    except DockerException as exc:
        return f"no Docker engine: {exc}"
    return None


class DockerBackendConfig(BaseModel):
    image: str = Field(DEFAULT_IMAGE, description="Kernel image used when a spec names none.")
    state_dir: Path = Field(default_factory=default_state_dir)
    orchestrator_id: str = Field(
        "default",
        description="Names this orchestrator in container labels. Orphan clean-up removes only "
        "containers with this id whose owner process is provably gone.",
    )
    docker_host: str | None = Field(
        None, description="Engine URL; None uses DOCKER_HOST or the default socket."
    )
    python: str = "/opt/kernel/bin/python"
    kernel_path: str = IMAGE_PATH
    host_uid_base: int = Field(
        1_600_000,
        description="Sandbox i runs as host uid host_uid_base + i (never a real user); apart "
        "from the local backend's range, so the two never share a uid.",
    )
    host_uid_count: int = 10_000
    runtime: str | None = Field(None, description="OCI runtime, e.g. 'runsc' for gVisor.")
    session_cgroup: bool = Field(
        True,
        description="Where this service runs as root beside the engine (cgroup v1, the "
        "cgroupfs driver), hold every container of a sandbox (one per language) in one parent "
        "cgroup with the sandbox's memory, pids and CPU limits, so that the limits bind the "
        "sandbox as a whole and not each kernel alone.",
    )
    zygote_modules: list[str] = Field(
        default_factory=list,
        description="Modules a kernel zygote imports once, in a container of the backend's "
        "image (`image`, never a template) in the host's PID namespace: Python's kernels are "
        "then forked from it into their containers, those modules loaded and their memory "
        "shared between every kernel (docs/security.md). Only under runc with "
        "`session_cgroup` in effect (this service as root beside the engine). Empty: each "
        "kernel is started afresh.",
    )
    cpu_weight_per_sandbox: bool = Field(
        default=True,
        description="With session_cgroup: weigh the sandboxes' parent group as one process per "
        "live sandbox among the host's others (cpu.shares 1024 each), so a busy host does not "
        "squeeze every session into one process's share (at most one per core); off, the "
        "parent's weight is left as it is.",
    )


class DockerBackend(Backend):
    name = "docker"
    capabilities = BackendCapabilities(
        network_modes=("none", "allow_list", "any"),
        host_tools=True,
        processes=True,
        suspend=False,  # no CRIU here: pausing saves the kernel's state instead
        snapshot=True,
        shared_across_nodes=False,
        images=True,
        runtimes=True,
        warm_pool=True,
        labels_sandboxes=True,  # containers in an engine other services may use
        host_dirs=True,  # the workspace and kernel directories its containers bind
        ports=True,
        mounts=True,
        egress_files=True,
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(DockerBackendConfig(**config))

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        self.config = config or DockerBackendConfig()
        self._client: docker.DockerClient | None = None
        self._deaths: DeathWatch | None = None
        # Each sandbox's host uid, its own while it lives (sandbox/uids.py says why).
        self.uids = HostUidPool(self.config.host_uid_base, self.config.host_uid_count)
        self._connect_lock = asyncio.Lock()
        self._cgroupfs: bool | None = None  # whether sandboxes get a parent cgroup (found once)
        self._engine_default_runtime: str | None = None  # the engine's own default
        self._engine_runtime_paths: dict[str, str] | None = None  # runtime name -> its program
        self._zygote: DockerZygote | None = None  # the configured image's, once asked for
        self._labels_by_container = False  # the engine gives each container an SELinux label

    async def _connect(self) -> tuple[docker.DockerClient, DeathWatch]:
        async with self._connect_lock:
            if self._client is None or self._deaths is None:
                client = await asyncio.to_thread(self._open_client)
                self._deaths = await asyncio.to_thread(
                    DeathWatch, client, self.config.orchestrator_id
                )
                self._client = client
            return self._client, self._deaths

    def _open_client(self) -> docker.DockerClient:
        where = self.config.docker_host or os.environ.get("DOCKER_HOST") or "the default socket"
        try:
            client = (
                docker.DockerClient(base_url=self.config.docker_host)
                if self.config.docker_host
                else docker.from_env()
            )
            client.ping()
        except DockerException as exc:
            raise BackendUnavailable(
                f"cannot reach a Docker engine at {where}: {exc}. {ENGINE_HINT}"
            ) from None
        return client

    async def create(self, spec: SandboxSpec | None = None) -> DockerSandbox:
        spec = spec or SandboxSpec()
        client, deaths = await self._connect()
        image = spec.image or self.config.image
        kernels = await self._image_programs(client, image)
        runtime, gvisor = await self._runtime_for(client, spec)
        parent_cgroup = self.config.session_cgroup and await self._shares_cgroups(client)
        engine = _Engine(
            client,
            deaths,
            image,
            kernels,
            runtime,
            gvisor,
            parent_cgroup=parent_cgroup,
            zygote=self._zygote_for(client, image) if parent_cgroup and not gvisor else None,
        )
        return await _DockerRecipe(self, spec, engine).make()

    def _zygote_for(self, client: docker.DockerClient, image: str) -> DockerZygote | None:
        """The zygote that forks kernels of `image`: only the backend's own image's (a
        template's code is its builder's, never to run in the zygote's privileges)."""
        if not self.config.zygote_modules or image != self.config.image:
            return None
        if self._labels_by_container:
            return None
        if self._zygote is None:
            self._zygote = DockerZygote(
                client,
                image,
                self.config.python,
                self.config.kernel_path,
                list(self.config.zygote_modules),
                self.config.orchestrator_id,
                Path(tempfile.mkdtemp(prefix="cir-docker-zygote-")),  # root's alone (0700)
            )
        return self._zygote

    async def runtimes(self) -> list[str]:
        """The OCI runtimes the engine knows (`runc`, and `runsc` once registered: setup does
        it), asked afresh: an engine reloaded with SIGHUP may have gained one."""
        client, _ = await self._connect()
        return await self._engine_runtimes(client)

    async def _engine_runtimes(self, client: docker.DockerClient) -> list[str]:
        try:
            info = await asyncio.to_thread(client.info)
        except DockerException as exc:
            raise BackendUnavailable(f"the Docker engine did not answer: {exc}") from None
        self._engine_default_runtime = str(info.get("DefaultRuntime") or "runc")
        runtimes: dict[str, Any] = info.get("Runtimes") or {}
        self._engine_runtime_paths = {
            name: str((entry or {}).get("path") or name) for name, entry in runtimes.items()
        }
        return sorted(runtimes)

    async def _runtime_for(
        self, client: docker.DockerClient, spec: SandboxSpec
    ) -> tuple[str, bool]:
        """The runtime a sandbox of `spec` runs under (its own, the deployment's, or the
        engine's default) and whether it is gVisor; one the engine does not know is refused
        before anything is made."""
        if spec.runtime is not None or self._engine_runtime_paths is None:
            known = await self._engine_runtimes(client)  # afresh: a reload may have added one
            if spec.runtime is not None and spec.runtime not in known:
                raise RuntimeUnavailable(
                    f"the Docker engine has no runtime {spec.runtime!r}; it has: "
                    f"{', '.join(known)}. gVisor (runsc) is registered by "
                    "scripts/ensure-docker-engine.sh (docs/gvisor.md)"
                )
        runtime = spec.runtime or self.config.runtime or self._engine_default_runtime or "runc"
        program = (self._engine_runtime_paths or {}).get(runtime, runtime)
        return runtime, Path(program).name == GVISOR_PROGRAM

    async def _shares_cgroups(self, client: docker.DockerClient) -> bool:
        """Whether a parent cgroup made here is the one the engine's containers join: this
        service can make groups (root, cgroup v1), the engine is on this machine (a Unix
        socket) and manages cgroups itself (cgroupfs: systemd's driver wants a slice)."""
        if self._cgroupfs is None:
            engine = self.config.docker_host or os.environ.get("DOCKER_HOST") or "unix://"
            if not engine.startswith("unix://") or not cgroups.available():
                self._cgroupfs = False
            else:
                info = await asyncio.to_thread(client.info)
                self._cgroupfs = (
                    info.get("CgroupDriver") == "cgroupfs" and str(info.get("CgroupVersion")) == "1"
                )
                # A process keeps its SELinux label through a fork and setns: a kernel forked
                # from the zygote would carry the zygote's, not its own container's categories.
                self._labels_by_container = any(
                    "name=selinux" in str(option) for option in info.get("SecurityOptions") or []
                )
        return self._cgroupfs

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        client, _ = await self._connect()
        image = (spec.image if spec else None) or self.config.image
        return (await self._image_programs(client, image)).languages

    async def templates(self) -> list[str]:
        client, _ = await self._connect()
        try:
            images = await asyncio.to_thread(
                client.images.list, filters={"label": TEMPLATE_LABEL, "dangling": False}
            )
        except DockerException as exc:
            raise BackendUnavailable(f"the Docker engine did not answer: {exc}") from None
        return sorted({n for image in images if (n := named_template(image.labels, image.tags))})

    async def _image_programs(self, client: docker.DockerClient, image: str) -> KernelPrograms:
        """The kernels of `image`, from its languages label."""
        try:
            found = await asyncio.to_thread(client.images.get, image)
        except ImageNotFound:
            if template_name_of(image) is not None:
                raise BackendUnavailable(
                    f"there is no template image {image!r} on this engine: build it with "
                    "`code-interpreter template build -f Dockerfile --name NAME`"
                ) from None
            raise BackendUnavailable(
                f"the kernel image {image!r} is not on this engine: build it with `make image` "
                "or `code-interpreter image build`"
            ) from None
        except DockerException as exc:  # the engine went away, or failed: a typed refusal
            raise BackendUnavailable(f"the Docker engine did not answer: {exc}") from None
        refuse_unbuilt_template(image, found.labels)
        return image_programs(found.labels, self.config.python, STARTUP_FILE_IN_SANDBOX)

    async def cleanup_orphans(self) -> int:
        """Remove the containers of our orchestrator id whose owner process is provably gone,
        and the directories of gone owners.

        Only what is provably dead: a live owner's containers (another service sharing the id,
        or this one) are never touched, and those whose owner cannot be checked from here
        (another host, boot or PID namespace, or no owner labels) are left and logged.
        """
        client, _ = await self._connect()
        label = f"{LABEL_ORCHESTRATOR}={self.config.orchestrator_id}"
        containers = await asyncio.to_thread(
            client.containers.list, all=True, filters={"label": label}
        )
        removed = 0
        for container in containers:
            owner = ProcessIdentity.from_labels(container.labels, LABEL_OWNER)
            state = owner.state() if owner is not None else OwnerState.UNKNOWN
            if state is OwnerState.ALIVE:
                continue
            if state is OwnerState.UNKNOWN:
                log.warning(
                    "leaving container %s alone: its owner (%s) cannot be checked from here "
                    "(another host, boot or PID namespace). If it is an orphan, remove it "
                    "with `docker rm -f %s`.",
                    container.name,
                    owner or "not recorded",
                    container.name,
                )
                continue
            log.info(
                "removing orphaned container %s (its owner, %s, is gone)", container.name, owner
            )
            if await remove_container(container):
                removed += 1
        dirs = await asyncio.to_thread(SessionDirs.remove_orphans, self.config.state_dir, self.name)
        if cgroups.available():  # the parent groups of exactly those sandboxes, if any
            for sandbox_id in dirs:
                await asyncio.to_thread(_remove_group, cgroups.SandboxCgroup(sandbox_id))
        return removed + len(dirs)

    async def close(self) -> None:
        if self._zygote is not None:  # its kernels live on, each with its keeper
            await self._zygote.close()
            self._zygote = None
        if self._deaths is not None:
            self._deaths.close()
        if self._client is not None:
            self._client.close()
        self._client = self._deaths = None


@dataclass(frozen=True)
class _Engine:
    """What a sandbox's containers run with, found before anything of it is made."""

    client: docker.DockerClient
    deaths: DeathWatch
    image: str
    kernels: KernelPrograms  # the image's
    runtime: str
    gvisor: bool
    # Its containers share a parent cgroup holding the sandbox's limits (`session_cgroup`).
    parent_cgroup: bool
    zygote: DockerZygote | None = None  # forks its Python kernels (`zygote_modules`)


class _DockerRecipe(KernelRecipe["DockerSandbox"]):
    """A Docker sandbox's steps of the recipe (kernel_recipe.py): a host uid of its own, a
    parent cgroup for its containers where the engine shares them, the user database its
    containers read, and one container per kernel."""

    def __init__(self, backend: DockerBackend, spec: SandboxSpec, engine: _Engine) -> None:
        super().__init__(spec)
        self.backend = backend
        self.engine = engine
        self.uid: int | None = None  # given back once the sandbox's containers are gone
        self.dirs: SessionDirs | None = None
        self.group: cgroups.SandboxCgroup | None = None
        self.python_launcher: ContainerLauncher | None = None  # processes exec in its container

    @property
    def owner(self) -> tuple[int, int] | None:
        """Who owns the workspace: the sandbox's uid, as root (else its mode lets it in)."""
        return (self.uid, self.uid) if self.uid is not None and os.geteuid() == 0 else None

    async def make_dirs(self) -> SessionDirs:
        self.uid = self.backend.uids.allocate()
        self.dirs = await asyncio.to_thread(
            SessionDirs.create,
            self.backend.config.state_dir,
            self.backend.name,
            self.sandbox_id,
            workspace_size_mb=self.spec.limits.workspace_size_mb,
            owner=self.owner,
            root_mode=0o700,  # the engine binds the subdirectories; nobody else needs in
        )
        return self.dirs

    async def prepare(self, dirs: SessionDirs) -> None:
        assert self.uid is not None
        if self.engine.parent_cgroup:
            self.group = cgroups.SandboxCgroup(
                self.sandbox_id, scale_parent=self.backend.config.cpu_weight_per_sandbox
            )
            host_limits = self.spec.limits
            if self.engine.gvisor:  # the host group holds gVisor's own tasks too: a backstop
                host_limits = host_limits.model_copy(
                    update={"pids": gvisor_host_pids(host_limits.pids)}
                )
            await asyncio.to_thread(self.group.create, host_limits)
        write_user_database(dirs, self.uid)
        if os.geteuid() != 0:  # the container's uid must create files in it
            dirs.workspace.chmod(0o777)

    def channel_peer(self) -> ChannelPeer:
        assert self.uid is not None
        # Under gVisor the host sees its gofer (root) connect, not the sandbox's uid; the
        # directories are bound into this sandbox alone, which holds the gate there.
        if self.engine.gvisor:
            return ChannelPeer(GVISOR_SOCKET_PEER[0], self.uid, GVISOR_SOCKET_PEER[1])
        return ChannelPeer(self.uid, self.uid)

    def launcher(self, language: str) -> ContainerLauncher:
        assert self.dirs is not None and self.uid is not None
        engine, config = self.engine, self.backend.config
        forking = language == PYTHON and engine.zygote is not None
        launcher = (ForkingContainerLauncher if forking else ContainerLauncher)(
            engine.client,
            engine.deaths,
            self.spec,
            self.dirs,
            self.sandbox_id,
            engine.image,
            self.uid,
            engine.kernels,
            orchestrator_id=config.orchestrator_id,
            kernel_path=config.kernel_path,
            channel=self.host_channel,
            language=language,
            cgroup_parent=f"/{cgroups.PARENT}/{self.sandbox_id}" if self.group else None,
            runtime=engine.runtime,
            gvisor=engine.gvisor,
            egress=self.egress_channel,
        )
        if isinstance(launcher, ForkingContainerLauncher):
            assert engine.zygote is not None
            launcher.zygote = engine.zygote
        if language == PYTHON:
            self.python_launcher = launcher
        return launcher

    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> DockerSandbox:
        assert self.python_launcher is not None and self.uid is not None
        uids, uid, group = self.backend.uids, self.uid, self.group
        return DockerSandbox(
            self.sandbox_id,
            self.spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace), owner=self.owner),
            self.python_launcher,
            on_close=lambda: _closed(uids, uid, group),
            languages=self.engine.kernels.languages,
            make_driver=self.driver,
            cpu_group=group,
        )

    async def undo(self) -> None:
        if self.group is not None:
            await asyncio.to_thread(_remove_group, self.group)
        if self.uid is not None:
            self.backend.uids.release(self.uid)


class DockerSandbox(KernelSandbox):
    backend = "docker"

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
        launcher: ContainerLauncher,
        on_close: Callable[[], None],
        languages: list[str] | None = None,
        make_driver: Callable[[str], KernelDriver] | None = None,
        cpu_group: cgroups.SandboxCgroup | None = None,
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._launcher = launcher
        self._on_close = on_close
        self._cpu_group = cpu_group

    def weigh_cpu(self, *, background: bool) -> None:
        # Its containers' parent group, where the engine shares cgroups with this service
        # (`session_cgroup`); otherwise there is none and the weight stays the engine's.
        if self._cpu_group is not None:  # cgroup writes, quick enough to make on the loop
            self._cpu_group.weigh(background=background)

    @property
    def container_name(self) -> str | None:
        """The container running the current kernel."""
        return self._launcher.current_name

    @property
    def uid(self) -> int:
        """The host uid its containers run as, its alone while it lives."""
        return self._launcher.uid

    @property
    def runtime(self) -> str:  # type: ignore[override]
        """The OCI runtime its containers run under, as the engine names it."""
        return self._launcher.runtime

    def spawner(self) -> Spawner:
        """Processes in the current kernel's container: forked by its command server under runc
        (docker_command_server.py), execs under gVisor (docker_processes.py). Replacing the
        kernel replaces its container, and so ends every process started in it."""
        launcher = self._launcher
        container = lambda: (launcher.current_name, launcher.current_exited)  # noqa: E731
        user = f"{launcher.uid}:{launcher.uid}"
        if launcher.gvisor:
            return DockerSpawner(launcher.client, container, user, launcher.process_environment)
        return DockerServedSpawner(
            launcher.client,
            container,
            user,
            launcher.process_environment,
            launcher.kernels.python,
            lambda: launcher.kernel_dir,
        )

    async def _teardown(self) -> None:
        try:
            await super()._teardown()
        finally:
            if await self._launcher.containers_gone():  # only then may its uid serve another
                self._on_close()
            else:  # kept claimed until this process ends; the next start's clean-up removes it
                log.warning(
                    "the engine did not remove the container of sandbox %s: its uid %d stays "
                    "out of the pool",
                    self.id,
                    self.uid,
                )


def _remove_group(group: cgroups.SandboxCgroup) -> None:
    group.remove()
    cgroups.remove_engine_parents(group.sandbox_id)


def _closed(uids: HostUidPool, uid: int, group: cgroups.SandboxCgroup | None) -> None:
    """Once a sandbox's containers are gone: its parent cgroup, then its uid."""
    if group is not None:
        _remove_group(group)
    uids.release(uid)
