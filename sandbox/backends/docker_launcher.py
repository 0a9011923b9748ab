"""How a Docker sandbox's kernels start: one hardened container per kernel, and its options.

The container has no network (`network_mode=none`), a read-only root, a size-capped /tmp, no
capabilities, no new privileges, a pids limit, memory without extra swap, a CPU quota, ulimits,
an init process, a capped engine log, and labels naming the sandbox, the orchestrator id and the
very process that owns it. The kernel is the container's main process and is reached over
ZeroMQ ipc sockets in a bind-mounted host directory: no port is published.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound
from docker.types import LogConfig, Mount, Ulimit
from requests.exceptions import RequestException

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import seccomp
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX
from sandbox.backends.docker_container import (
    LABEL_ORCHESTRATOR,
    LABEL_OWNER,
    LABEL_SANDBOX,
    DeathWatch,
    KernelContainer,
    remove_container,
)
from sandbox.egress_channel import (
    EGRESS_DIR_IN_SANDBOX,
    FORWARDER_FILE,
    FORWARDER_IN_SANDBOX,
    EgressChannel,
    proxy_environment,
    with_forwarder,
)
from sandbox.host_channel import HOST_TOOLS_DIR_IN_SANDBOX, HOST_TOOLS_ENV, HostChannel
from sandbox.kernel.command import kernel_environment
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
from sandbox.process_identity import ProcessIdentity
from sandbox.run_to_end import finish_even_if_cancelled
from sandbox.state_dir import SessionDirs

log = logging.getLogger(__name__)

# What the kernel writes to its original stdout and stderr lands in the engine's log, outside
# every quota of the sandbox: at most two files of this size. `diagnostics()` needs only the
# last lines of a kernel that died at start-up.
KERNEL_LOG_FILE_BYTES = 512 << 10
KERNEL_LOG_FILES = 2


class ContainerLauncher:
    def __init__(
        self,
        client: docker.DockerClient,
        deaths: DeathWatch,
        spec: SandboxSpec,
        dirs: SessionDirs,
        sandbox_id: str,
        image: str,
        uid: int,
        kernels: KernelPrograms,
        *,
        orchestrator_id: str,
        kernel_path: str,
        channel: HostChannel | None = None,
        language: str = PYTHON,
        cgroup_parent: str | None = None,
        runtime: str = "runc",
        gvisor: bool = False,
        egress: EgressChannel | None = None,
    ) -> None:
        self.orchestrator_id = orchestrator_id  # labels its containers: see DeathWatch
        self.kernel_path = kernel_path  # the container's PATH
        self.egress = egress
        self.cgroup_parent = cgroup_parent
        self.runtime = runtime
        self.gvisor = gvisor
        self.language = language
        self.kernels = kernels
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

    async def launch(self, connection_file_in_sandbox: str) -> KernelContainer:
        name = self._next_name()
        options = self._container_options(name, connection_file_in_sandbox)
        return await self._start_container(name, options, KernelContainer)

    def _next_name(self) -> str:
        self.generation += 1
        which = "" if self.language == PYTHON else f"{self.language}-"
        return f"code-interpreter-{self.sandbox_id}-{which}{self.generation}"

    async def _start_container(
        self,
        name: str,
        options: dict[str, Any],
        process_type: Callable[[Any, asyncio.Future[KernelExit]], KernelContainer],
    ) -> KernelContainer:
        """Create and start the container `options` describe, watched for its death from
        before it starts; the process `process_type` makes of it."""
        # A sandbox closed while its kernel is replaced (a command can kill the kernel at any
        # time) cancels this launch; the engine makes and starts the container all the same, so
        # it is removed before the cancellation goes on: the close then finds nothing of it.
        try:
            container = await finish_even_if_cancelled(
                asyncio.to_thread(self.client.containers.create, **options)
            )
        except BaseException as exc:
            # Cancelled, or failed where the engine may have made it all the same (a call
            # that timed out): whatever bears its name goes.
            await finish_even_if_cancelled(self._remove_named(name))
            if isinstance(exc, APIError | DockerException | RequestException):
                raise SandboxStartError(
                    f"the engine refused to create the container: {exc}"
                ) from exc
            raise
        process = process_type(container, asyncio.get_running_loop().create_future())
        self.deaths.watch(container.id, process)
        try:
            await finish_even_if_cancelled(asyncio.to_thread(container.start))
        except BaseException as exc:
            self.deaths.forget(container.id)  # never started: no death will be reported
            await finish_even_if_cancelled(process.kill())
            if isinstance(exc, APIError | DockerException | RequestException):
                raise SandboxStartError(f"the container did not start: {exc}") from exc
            raise
        if self.language == PYTHON:  # processes run beside Python's kernel
            self.current_name = name
            self.current_exited = process.exited
        return process

    async def _remove_named(self, name: str) -> None:
        """Remove this sandbox's container named `name`, if the engine made it; if the engine
        cannot be asked, the next start's clean-up of orphans removes it."""
        try:
            container = await asyncio.to_thread(self.client.containers.get, name)
        except NotFound:
            return
        except (APIError, DockerException, RequestException) as exc:
            log.warning("could not look for the container %s of a failed launch: %s", name, exc)
            return
        await remove_container(container)

    def process_environment(self) -> dict[str, str]:
        """What a process adds to the container's environment: the session's variables as they
        are now (`set_env` may have added some since the container started)."""
        extra = dict(self.spec.env)
        if self.egress is not None:  # first: the session's own variables may change them
            extra = {**proxy_environment(), **extra}
        if self.channel is not None:  # last: the caller's variables cannot move it
            extra[HOST_TOOLS_ENV] = HOST_TOOLS_DIR_IN_SANDBOX
        return extra

    def kernel_command(self, connection_file: str) -> list[str]:
        return self.kernels.command(
            self.language, connection_file, KERNEL_DIR_IN_SANDBOX, self.spec.limits
        )

    def kernel_env(self) -> dict[str, str]:
        """The kernel's environment: the session's variables with the sandbox's own."""
        extra = {**language_environment(self.language), **self.process_environment()}
        return kernel_environment(
            path=self.kernel_path, home="/tmp", limits=self.spec.limits, extra=extra
        )

    def _container_options(
        self, name: str, connection_file: str, command: list[str] | None = None
    ) -> dict[str, Any]:
        """The container's options; `command` instead of the kernel's (a holder that a
        forked kernel joins: docker_forked_kernel.py)."""
        limits = self.spec.limits
        env = self.kernel_env()
        if command is None:
            command = self.kernel_command(connection_file)
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
                LABEL_ORCHESTRATOR: self.orchestrator_id,
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
                str(COMMAND_SERVER_FILE): {"bind": COMMAND_SERVER_IN_SANDBOX, "mode": "ro"},
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
                Ulimit(name=name, soft=value, hard=value) for name, value in ulimits(limits)
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
        for m in self.spec.mounts:  # volumes (after the workspace: one may be inside it)
            options["mounts"].append(
                Mount(target=m.path, source=m.source, type="bind", read_only=m.read_only)
            )
        if self.cgroup_parent:
            options["cgroup_parent"] = self.cgroup_parent
        return options


def ulimits(limits: ResourceLimits) -> list[tuple[str, int]]:
    """Every container's rlimits, by the engine's names (`nofile`, `fsize`, `core`)."""
    return [
        ("nofile", limits.open_files),
        ("fsize", limits.file_size_mb << 20),
        ("core", 0),
    ]


def gvisor_host_pids(pids: int) -> int:
    """The host pids limit of a sandbox under gVisor: its own processes (each costs ~8 host
    tasks on the ptrace platform: a stub process with its threads, and gVisor's) and gVisor's
    own (~100 threads). Measured, with room to spare."""
    return 10 * pids + 256


def write_user_database(dirs: SessionDirs, uid: int) -> None:
    """The container's /etc/passwd and /etc/group: `sandbox` is the sandbox's own uid."""
    (dirs.etc / "passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (dirs.etc / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
