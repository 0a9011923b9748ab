"""The production backend: one hardened container per kernel, on a real Docker engine.

The container has no network (`network_mode=none`), a read-only root, a size-capped /tmp, no
capabilities, no new privileges, a pids limit, memory without extra swap, a CPU quota, ulimits,
an init process, a capped engine log, and labels naming the sandbox, the orchestrator id and the
very process that owns it. Each sandbox runs as a host uid of its own (per-uid kernel quotas are
not shared between sessions). The kernel is the container's main process and is reached over
ZeroMQ ipc sockets in a bind-mounted host directory: no port is published.

The workspace is a host directory bound in (a size-capped tmpfs when the orchestrator is root),
so files outlive the container: replacing a dead or stuck kernel is replacing its container, and
the session's files stay. Deaths are learnt from the engine's event stream, not by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import LogConfig, Mount, Ulimit
from pydantic import BaseModel, Field

from kernel_images.labels import KERNEL_IMAGE
from sandbox import cgroups, seccomp
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX, Backend
from sandbox.backends.docker_processes import DockerSpawner
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.egress_channel import (
    EGRESS_DIR_IN_SANDBOX,
    FORWARDER_FILE,
    FORWARDER_IN_SANDBOX,
    EgressChannel,
    proxy_environment,
    with_forwarder,
)
from sandbox.errors import BackendUnavailable, RuntimeUnavailable, SandboxStartError
from sandbox.host_channel import HOST_TOOLS_DIR_IN_SANDBOX, HOST_TOOLS_ENV, HostChannel
from sandbox.kernel.command import STARTUP_FILE_IN_SANDBOX, kernel_environment
from sandbox.kernel.connection import KERNEL_DIR_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.process import KernelExit
from sandbox.kernel.programs import (
    SUPERVISOR_FILE,
    SUPERVISOR_IN_SANDBOX,
    KernelPrograms,
    image_programs,
    language_environment,
)
from sandbox.languages import PYTHON
from sandbox.process_identity import OwnerState, ProcessIdentity
from sandbox.socket_peer import SocketPeer
from sandbox.spec import SandboxSpec
from sandbox.state_dir import SessionDirs, default_state_dir
from sandbox.uids import HostUidPool
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

LABEL_SANDBOX = "code-interpreter.sandbox"
LABEL_ORCHESTRATOR = "code-interpreter.orchestrator"
LABEL_OWNER = "code-interpreter.owner"  # prefix of the owner process's labels (pid, start...)
# What the kernel writes to its original stdout and stderr lands in the engine's log, outside
# every quota of the sandbox: at most two files of this size. `diagnostics()` needs only the
# last lines of a kernel that died at start-up.
KERNEL_LOG_FILE_BYTES = 512 << 10
KERNEL_LOG_FILES = 2
# An OOM kill reported this shortly before a container died killed its kernel (measured: the
# report comes ~40 ms before the death); one reported earlier killed a command beside it.
OOM_BEFORE_DEATH_S = 5.0
# Reports (OOM kills, kill requests) of containers nobody watches (gone while the event stream
# was down, or never ours to watch) are dropped once this old; and at most this many are kept.
REPORT_KEPT_S = 60.0
MAX_REPORTS = 10_000
DEFAULT_IMAGE = KERNEL_IMAGE
GVISOR_PROGRAM = "runsc"  # a runtime whose program this is runs sandboxes under gVisor
# Who the host sees at the other end of a host socket a gVisor sandbox connects to (uid and
# program): its gofer, which runs as root (runsc --host-uds), not the sandbox's uid.
GVISOR_SOCKET_PEER = (0, "runsc-gofer")
ENGINE_HINT = (
    "Start a Docker engine (`sudo systemctl start docker`, or on a machine without systemd "
    "`sudo dockerd --bridge=none --iptables=false --ip-masq=false &`) or point DOCKER_HOST at one."
)


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
    kernel_path: str = "/opt/kernel/bin:/usr/local/bin:/usr/bin:/bin"
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


class DockerBackend(Backend):
    name = "docker"

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        self.config = config or DockerBackendConfig()
        self._client: docker.DockerClient | None = None
        self._deaths: _DeathWatch | None = None
        # Each sandbox's host uid, its own while it lives (sandbox/uids.py says why).
        self.uids = HostUidPool(self.config.host_uid_base, self.config.host_uid_count)
        self._connect_lock = asyncio.Lock()
        self._cgroupfs: bool | None = None  # whether sandboxes get a parent cgroup (found once)
        self._engine_default_runtime: str | None = None  # the engine's own default
        self._engine_runtime_paths: dict[str, str] | None = None  # runtime name -> its program

    async def _connect(self) -> tuple[docker.DockerClient, _DeathWatch]:
        async with self._connect_lock:
            if self._client is None or self._deaths is None:
                client = await asyncio.to_thread(self._open_client)
                self._deaths = await asyncio.to_thread(
                    _DeathWatch, client, self.config.orchestrator_id
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
        sandbox_id = secrets.token_hex(8)
        root = os.geteuid() == 0
        uid = self.uids.allocate()  # given back once the sandbox's containers are gone
        owner = (uid, uid) if root else None
        try:
            dirs = await asyncio.to_thread(
                SessionDirs.create,
                self.config.state_dir,
                self.name,
                sandbox_id,
                workspace_size_mb=spec.limits.workspace_size_mb,
                owner=owner,
                root_mode=0o700,  # the engine binds the subdirectories; nobody else needs in
            )
        except BaseException:
            self.uids.release(uid)
            raise
        group: cgroups.SandboxCgroup | None = None
        try:
            if self.config.session_cgroup and await self._shares_cgroups(client):
                group = cgroups.SandboxCgroup(sandbox_id)
                host_limits = spec.limits
                if gvisor:  # the host group holds gVisor's own tasks too: a backstop there
                    host_limits = host_limits.model_copy(
                        update={"pids": gvisor_host_pids(host_limits.pids)}
                    )
                await asyncio.to_thread(group.create, host_limits)
            _write_user_database(dirs, uid)
            if not root:  # the container's uid must create files in it
                dirs.workspace.chmod(0o777)
            channel = None
            if spec.host_tools:
                # Under gVisor the host sees its gofer (root) connect, not the sandbox's uid;
                # the directory is bound into this sandbox alone, which holds the gate there.
                channel = HostChannel.create(
                    dirs.host_tools,
                    peer_uid=GVISOR_SOCKET_PEER[0] if gvisor else uid,
                    peer_gid=uid,
                    peer_program=GVISOR_SOCKET_PEER[1] if gvisor else None,
                )
            egress = None
            if spec.network.enabled:
                peer = SocketPeer(*GVISOR_SOCKET_PEER) if gvisor else SocketPeer(uid)
                egress = EgressChannel.create(dirs.egress, peer=peer, peer_gid=uid)

            def launcher_of(language: str) -> _ContainerLauncher:
                return _ContainerLauncher(
                    self.config,
                    client,
                    deaths,
                    spec,
                    dirs,
                    sandbox_id,
                    image,
                    uid,
                    channel,
                    language,
                    kernels,
                    cgroup_parent=f"/{cgroups.PARENT}/{sandbox_id}" if group else None,
                    runtime=runtime,
                    gvisor=gvisor,
                    egress=egress,
                )

            launcher = launcher_of(PYTHON)
            driver = KernelDriver.for_spec(launcher, spec)
            try:
                await driver.start()
            except BaseException:
                await driver.close()
                raise
        except BaseException:
            await asyncio.to_thread(dirs.remove)
            if group is not None:
                await asyncio.to_thread(_remove_group, sandbox_id)
            self.uids.release(uid)
            raise
        sandbox = DockerSandbox(
            sandbox_id,
            spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace), owner=owner),
            launcher,
            on_close=lambda: _closed(self.uids, uid, sandbox_id if group else None),
            languages=kernels.languages,
            make_driver=lambda language: KernelDriver.for_spec(
                launcher_of(language), spec, language
            ),
        )
        sandbox.host_channel = channel
        sandbox.egress_channel = egress
        return sandbox

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
        return self._cgroupfs

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        client, _ = await self._connect()
        image = (spec.image if spec else None) or self.config.image
        return (await self._image_programs(client, image)).languages

    async def _image_programs(self, client: docker.DockerClient, image: str) -> KernelPrograms:
        """The kernels of `image`, from its languages label."""
        try:
            found = await asyncio.to_thread(client.images.get, image)
        except ImageNotFound:
            raise BackendUnavailable(
                f"the kernel image {image!r} is not on this engine: build it with `make image` "
                "or `code-interpreter image build`"
            ) from None
        except DockerException as exc:  # the engine went away, or failed: a typed refusal
            raise BackendUnavailable(f"the Docker engine did not answer: {exc}") from None
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
            with contextlib.suppress(NotFound):
                await asyncio.to_thread(container.remove, force=True)
            removed += 1
        dirs = await asyncio.to_thread(SessionDirs.remove_orphans, self.config.state_dir, self.name)
        if cgroups.available():  # the parent groups of exactly those sandboxes, if any
            for sandbox_id in dirs:
                await asyncio.to_thread(_remove_group, sandbox_id)
        return removed + len(dirs)

    async def close(self) -> None:
        if self._deaths is not None:
            self._deaths.close()
        if self._client is not None:
            self._client.close()
        self._client = self._deaths = None


class DockerSandbox(KernelSandbox):
    backend = "docker"

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
        launcher: _ContainerLauncher,
        on_close: Callable[[], None],
        languages: list[str] | None = None,
        make_driver: Callable[[str], KernelDriver] | None = None,
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._launcher = launcher
        self._on_close = on_close

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

    def spawner(self) -> DockerSpawner:
        """Execs in the current kernel's container (docker_processes.py): replacing the kernel
        replaces its container, and so ends every process started in it."""
        launcher = self._launcher
        return DockerSpawner(
            launcher.client,
            lambda: (launcher.current_name, launcher.current_exited),
            f"{launcher.uid}:{launcher.uid}",
            launcher.process_environment,
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


_REMOVAL_ATTEMPTS = 5


class _Container:
    """A kernel's container, as a KernelProcess."""

    def __init__(self, container: Any, exited: asyncio.Future[KernelExit]) -> None:
        self.container = container
        self.exited = exited
        self.logs = ""

    async def wait(self) -> KernelExit:
        return await asyncio.shield(self.exited)

    async def kill(self) -> None:
        # Removing the container kills every process in it, daemons included. A busy engine
        # may fail a removal (its root filesystem still busy, a removal already under way):
        # asked again a few times, so a closed sandbox does not leave a dead container behind.
        for attempt in range(_REMOVAL_ATTEMPTS):
            try:
                await asyncio.to_thread(self.container.remove, force=True)
                break
            except NotFound:
                break
            except APIError as exc:
                if attempt + 1 == _REMOVAL_ATTEMPTS:
                    log.warning(
                        "the engine did not remove container %s: %s", self.container.id, exc
                    )
                else:
                    await asyncio.sleep(0.5)
        if not self.exited.done():
            self.exited.set_result(KernelExit("was killed by the orchestrator", None, 9))

    def diagnostics(self) -> str:
        return self.logs


class _ContainerLauncher:
    def __init__(
        self,
        config: DockerBackendConfig,
        client: docker.DockerClient,
        deaths: _DeathWatch,
        spec: SandboxSpec,
        dirs: SessionDirs,
        sandbox_id: str,
        image: str,
        uid: int,
        channel: HostChannel | None = None,
        language: str = PYTHON,
        kernels: KernelPrograms | None = None,
        cgroup_parent: str | None = None,
        runtime: str = "runc",
        gvisor: bool = False,
        egress: EgressChannel | None = None,
    ) -> None:
        self.config = config
        self.egress = egress
        self.cgroup_parent = cgroup_parent
        self.runtime = runtime
        self.gvisor = gvisor
        self.language = language
        self.kernels = kernels or image_programs(None, config.python, STARTUP_FILE_IN_SANDBOX)
        self.client = client
        self.deaths = deaths
        self.spec = spec
        self.dirs = dirs
        self.sandbox_id = sandbox_id
        self.image = image
        self.uid = uid
        self.channel = channel
        self.generation = 0
        self.current_name: str | None = None
        # Resolved when the current kernel's container dies or is removed (its processes with it).
        self.current_exited: asyncio.Future[KernelExit] | None = None

    async def containers_gone(self) -> bool:
        """Whether the engine holds no container of this sandbox any more."""
        try:
            left = await asyncio.to_thread(
                self.client.containers.list,
                all=True,
                filters={"label": f"{LABEL_SANDBOX}={self.sandbox_id}"},
            )
        except DockerException:
            return False
        return not left

    @property
    def kernel_dir(self) -> Path:
        return self.dirs.kernel_of(self.language)

    @property
    def kernel_dir_in_sandbox(self) -> str:
        return KERNEL_DIR_IN_SANDBOX

    @property
    def kernel_uid(self) -> int | None:
        """The uid the container runs as: it alone may read the connection file."""
        return self.uid

    async def launch(self, connection_file_in_sandbox: str) -> _Container:
        self.generation += 1
        which = "" if self.language == PYTHON else f"{self.language}-"
        name = f"code-interpreter-{self.sandbox_id}-{which}{self.generation}"
        options = self._container_options(name, connection_file_in_sandbox)
        # Shielded: a sandbox closed while its kernel is replaced (a command can kill the kernel
        # at any time) cancels this launch; the container then still gets made, and is removed.
        creating = asyncio.ensure_future(
            asyncio.to_thread(self.client.containers.create, **options)
        )
        try:
            container = await asyncio.shield(creating)
        except asyncio.CancelledError:
            creating.add_done_callback(_remove_once_created)
            raise
        except (APIError, DockerException) as exc:
            raise SandboxStartError(f"the engine refused to create the container: {exc}") from exc
        process = _Container(container, asyncio.get_running_loop().create_future())
        self.deaths.watch(container.id, process)
        try:
            await asyncio.shield(asyncio.to_thread(container.start))
        except BaseException as exc:
            await asyncio.shield(process.kill())
            if isinstance(exc, APIError | DockerException):
                raise SandboxStartError(f"the container did not start: {exc}") from exc
            raise
        if self.language == PYTHON:  # processes run beside Python's kernel
            self.current_name = name
            self.current_exited = process.exited
        return process

    def process_environment(self) -> dict[str, str]:
        """What a process adds to the container's environment: the session's variables as they
        are now (`set_env` may have added some since the container started)."""
        extra = dict(self.spec.env)
        if self.egress is not None:  # first: the session's own variables may change them
            extra = {**proxy_environment(), **extra}
        if self.channel is not None:  # last: the caller's variables cannot move it
            extra[HOST_TOOLS_ENV] = HOST_TOOLS_DIR_IN_SANDBOX
        return extra

    def _container_options(self, name: str, connection_file: str) -> dict[str, Any]:
        limits, cfg = self.spec.limits, self.config
        extra = {**language_environment(self.language), **self.process_environment()}
        env = kernel_environment(path=cfg.kernel_path, home="/tmp", limits=limits, extra=extra)
        command = self.kernels.command(
            self.language, connection_file, KERNEL_DIR_IN_SANDBOX, limits
        )
        if self.egress is not None:
            command = with_forwarder(self.kernels.python, command)
        memory = f"{limits.memory_mb}m"
        options: dict[str, Any] = {
            "image": self.image,
            "command": command,
            "name": name,
            "hostname": "sandbox",
            "user": f"{self.uid}:{self.uid}",
            "working_dir": self.spec.workdir,
            "environment": env,
            "labels": {
                LABEL_SANDBOX: self.sandbox_id,
                LABEL_ORCHESTRATOR: cfg.orchestrator_id,
                **ProcessIdentity.of_this_process().labels(LABEL_OWNER),
            },
            "network_mode": "none",
            "read_only": True,
            # exec: tools install helpers in /tmp and run them (the code can run anything anyway).
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,exec,size={limits.tmp_size_mb}m,mode=1777"},
            "volumes": {
                str(self.kernel_dir): {"bind": KERNEL_DIR_IN_SANDBOX, "mode": "rw"},
                # The supervisor of kernels that need one: this service's own copy, so every
                # image runs the version the host expects.
                str(SUPERVISOR_FILE): {"bind": SUPERVISOR_IN_SANDBOX, "mode": "ro"},
                str(FORWARDER_FILE): {"bind": FORWARDER_IN_SANDBOX, "mode": "ro"},
                str(self.dirs.workspace): {"bind": WORKSPACE_IN_SANDBOX, "mode": "rw"},
                # The image knows only the uid it was built with: name ours (getpass, pwd).
                str(self.dirs.etc / "passwd"): {"bind": "/etc/passwd", "mode": "ro"},
                str(self.dirs.etc / "group"): {"bind": "/etc/group", "mode": "ro"},
            },
            # The workspace again, as E2B's home (base.py says why).
            "mounts": [Mount(target=HOME_IN_SANDBOX, source=str(self.dirs.workspace), type="bind")],
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges", f"seccomp={seccomp.docker_profile()}"],
            "pids_limit": limits.pids,
            "mem_limit": memory,
            "memswap_limit": memory,  # the same figure: no swap on top
            "nano_cpus": int(limits.cpus * 1e9),
            "ulimits": [
                Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files),
                Ulimit(
                    name="fsize", soft=limits.file_size_mb << 20, hard=limits.file_size_mb << 20
                ),
                Ulimit(name="core", soft=0, hard=0),
            ],
            "init": True,
            "log_config": LogConfig(
                type=LogConfig.types.JSON,
                config={"max-size": str(KERNEL_LOG_FILE_BYTES), "max-file": str(KERNEL_LOG_FILES)},
            ),
            "ipc_mode": "private",
            "stdin_open": False,
            "detach": True,
        }
        if self.channel is not None:
            options["volumes"][str(self.channel.path)] = {
                "bind": HOST_TOOLS_DIR_IN_SANDBOX,
                "mode": "ro",
            }
        options["runtime"] = self.runtime
        if self.gvisor:
            # gVisor's kernel counts the sandbox's tasks against RLIMIT_NPROC (its uid is the
            # sandbox's alone in there): the pids limit, with a clean EAGAIN at fork. The host's
            # pids cgroup holds gVisor's own threads as well, so it gets a backstop instead:
            # reaching it would end the whole sandbox, not refuse one fork.
            options["ulimits"].append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
            options["pids_limit"] = gvisor_host_pids(limits.pids)
        if self.egress is not None:
            egress_dir = {"bind": EGRESS_DIR_IN_SANDBOX, "mode": "ro"}
            options["volumes"][str(self.egress.path)] = egress_dir
        if self.cgroup_parent:
            options["cgroup_parent"] = self.cgroup_parent
        return options


def gvisor_host_pids(pids: int) -> int:
    """The host pids limit of a sandbox under gVisor: its own processes (each costs ~8 host
    tasks on the ptrace platform: a stub process with its threads, and gVisor's) and gVisor's
    own (~100 threads). Measured, with room to spare."""
    return 10 * pids + 256


def _remove_once_created(creating: asyncio.Future[Any]) -> None:
    """Remove a container whose launch was given up while the engine made it."""
    if creating.cancelled() or creating.exception() is not None:
        return
    container = creating.result()
    removal = asyncio.ensure_future(asyncio.to_thread(container.remove, force=True))
    _removals.add(removal)
    removal.add_done_callback(_removal_done)


_removals: set[asyncio.Future[None]] = set()  # kept referenced until they finish


def _removal_done(removal: asyncio.Future[None]) -> None:
    _removals.discard(removal)
    if not removal.cancelled() and removal.exception() is not None:
        log.warning("could not remove an abandoned kernel container: %s", removal.exception())


def _remove_group(sandbox_id: str) -> None:
    cgroups.SandboxCgroup(sandbox_id).remove()
    cgroups.remove_engine_parents(sandbox_id)


def _closed(uids: HostUidPool, uid: int, group_of: str | None) -> None:
    """Once a sandbox's containers are gone: its parent cgroup, then its uid."""
    if group_of is not None:
        _remove_group(group_of)
    uids.release(uid)


def _write_user_database(dirs: SessionDirs, uid: int) -> None:
    """The container's /etc/passwd and /etc/group: `sandbox` is the sandbox's own uid."""
    (dirs.etc / "passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (dirs.etc / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")


class _DeathWatch:
    """Follows the engine's event stream and tells each kernel's future when its container dies.

    One stream serves every sandbox of the backend, so nothing polls. Subscribed before any
    container starts, so no death can slip by between start and watch. A death is blamed on
    memory only when the engine reported an OOM kill in the container just before it (an
    earlier one killed a command, not the kernel), and on the engine when it was asked to kill
    the container (`docker kill`); any other signal came from inside the sandbox.
    """

    def __init__(self, client: docker.DockerClient, orchestrator_id: str) -> None:
        self.client = client
        self.filters = {
            "type": "container",
            "event": ["die", "oom", "kill"],
            "label": [f"{LABEL_ORCHESTRATOR}={orchestrator_id}"],
        }
        self._watched: dict[str, tuple[asyncio.AbstractEventLoop, _Container]] = {}
        # Container id: the engine's time (ns) of its last OOM kill, or of a request to kill it.
        self._oom: dict[str, int] = {}
        self._killed: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stream = self.client.events(decode=True, filters=self.filters)
        self._thread = threading.Thread(target=self._run, name="docker-deaths", daemon=True)
        self._thread.start()

    def watch(self, container_id: str, process: _Container) -> None:
        with self._lock:
            self._watched[container_id] = (asyncio.get_running_loop(), process)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._stream.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                for event in self._stream:
                    self._handle(event)
            except Exception as exc:  # the stream broke: reconnect, then look for missed deaths
                if self._closed:
                    return
                log.warning("docker event stream broke (%s); reconnecting", exc)
            if self._closed:
                return
            try:
                self._stream = self.client.events(decode=True, filters=self.filters)
            except DockerException:
                threading.Event().wait(1.0)
                continue
            self._recheck()

    def _handle(self, event: dict[str, Any]) -> None:
        container_id = event.get("id", "")
        action = event.get("status") or event.get("Action")
        # The engine's own time of the event: when it happened, not when it was read.
        at = int(event.get("timeNano") or time.time_ns())
        if action in ("oom", "kill"):
            reports = self._oom if action == "oom" else self._killed
            reports.pop(container_id, None)  # the latest last: in order of arrival
            reports[container_id] = at
            self._forget_stale(reports, at)
            return
        if action != "die":
            return
        code = int(event.get("Actor", {}).get("Attributes", {}).get("exitCode", -1))
        self._died(container_id, code, at)

    def _died(self, container_id: str, code: int, died_at: int | None) -> None:
        """Tell the kernel of `container_id` how it died (`died_at`: the engine's time of the
        death, None when it was found dead rather than told)."""
        with self._lock:
            entry = self._watched.pop(container_id, None)
        oom_at = self._oom.pop(container_id, None)
        killed = self._killed.pop(container_id, None) is not None
        if entry is None:
            return
        loop, process = entry
        oom: bool | None = None  # no evidence yet
        if oom_at is not None and died_at is not None:
            oom = died_at - oom_at < OOM_BEFORE_DEATH_S * 1e9
        try:
            container = self.client.containers.get(container_id)
            if oom is None:  # no report came (the stream may have missed it): the engine's flag
                oom = bool(container.attrs["State"].get("OOMKilled"))
            process.logs = container.logs(tail=60).decode(errors="replace")
        except (NotFound, APIError):
            pass  # gone, or the engine would not say: nothing tells whether memory did it
        death = KernelExit.from_returncode(code, out_of_memory=oom, killed_from_outside=killed)
        loop.call_soon_threadsafe(_resolve, process.exited, death)

    def _forget_stale(self, reports: dict[str, int], now: int) -> None:
        """Drop the reports of containers nobody watches once old, and the oldest past the
        cap. A watched container's stay until it dies: its OOM kill long ago, found missing,
        would leave only the engine's OOM flag, which stays set for the container's life."""
        if not reports or now - next(iter(reports.values())) <= REPORT_KEPT_S * 1e9:
            stale = []  # in order of arrival: when the oldest is not old, none is
        else:
            with self._lock:
                stale = [
                    container_id
                    for container_id, at in reports.items()
                    if container_id not in self._watched and now - at > REPORT_KEPT_S * 1e9
                ]
        for container_id in stale:
            del reports[container_id]
        while len(reports) > MAX_REPORTS:
            del reports[next(iter(reports))]

    def _recheck(self) -> None:
        with self._lock:
            watched = list(self._watched)
        for container_id in watched:
            try:
                state = self.client.containers.get(container_id).attrs["State"]
            except NotFound:
                self._died(container_id, 137, None)  # gone: how it died is lost with it
                continue
            except APIError:
                continue
            if not state.get("Running"):
                self._died(container_id, int(state.get("ExitCode", -1)), None)


def _resolve(future: asyncio.Future[KernelExit], value: KernelExit) -> None:
    if not future.done():
        future.set_result(value)
