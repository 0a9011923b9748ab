"""A Docker backend's kernel zygote: sandbox/inside_kernel/kernel_zygote.py, run in a container
of the sandboxes' own image, so that what it imports (and so every forked kernel's code) is the
image's, at the image's paths.

The container is this service's, never a session's: the image the operator configured, never a
template (whose build a caller controls). Entering a sandbox's namespaces takes what a sandbox
never has: the host's PID namespace (a PID namespace can be entered only from an ancestor),
CAP_SYS_ADMIN and CAP_SYS_CHROOT (setns, chroot), CAP_SETUID/SETGID/SETPCAP (the keeper drops
to the sandbox's uid, its bounding set emptied). It has no network and a read-only root, and
runs nothing but its imports: each kernel's keeper takes the sandbox's limits and confinement
before anything of the session runs (kernel_zygote.py). Its descriptors come over a
SOCK_SEQPACKET socket it connects to, in a directory of root's bound into it alone; the service
takes one connection, from the container's own process, then stops listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import select
import shutil
import socket
import struct
from pathlib import Path
from typing import Any

import docker
from docker.errors import DockerException
from docker.types import LogConfig
from requests.exceptions import RequestException

from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.docker_container import LABEL_ORCHESTRATOR, LABEL_OWNER, remove_container
from sandbox.backends.kernel_zygote import (
    SINGLE_THREADED,
    START_TIMEOUT_S,
    ZYGOTE_FILE,
    Zygote,
    ZygoteFailed,
)
from sandbox.kernel.command import kernel_environment
from sandbox.kernel.programs import COMMAND_SERVER_FILE
from sandbox.process_identity import ProcessIdentity

log = logging.getLogger(__name__)

LABEL_ZYGOTE = "code-interpreter.zygote"  # the image whose kernels it forks
DIR_IN_CONTAINER = "/opt/code-interpreter-zygote"
SOCKET_DIR_IN_CONTAINER = "/run/code-interpreter-zygote"
SOCKET_NAME = "zygote.sock"
CAPABILITIES = ["SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "SETPCAP"]
# Its own memory (the modules' pages, which every forked kernel shares) and processes (keepers
# are its children only until they join their sandboxes' cgroups).
MEMORY = "4g"
PIDS = 512
_UCRED = struct.Struct("3i")


class DockerZygote(Zygote):
    """The zygote of one image: a container, started at its image's first forked kernel."""

    def __init__(
        self,
        client: docker.DockerClient,
        image: str,
        python: str,
        kernel_path: str,
        modules: list[str],
        orchestrator_id: str,
        home: Path,
    ) -> None:
        super().__init__(modules)
        self.client = client
        self.image = image
        self.python = python
        self.kernel_path = kernel_path
        self.orchestrator_id = orchestrator_id
        self.home = home  # root's (0700): its socket's directory, removed with it
        self.container: Any = None
        self.image_id = ""  # the engine's id of the image its container runs

    async def check_image(self, image_id: str) -> None:
        """Refuse a kernel whose container runs another build of the image (its tag rebuilt
        or pulled since the zygote started: the zygote's modules are the old build's): the
        zygote is stopped, so that the next fork starts one of the image as it is now."""
        if image_id == self.image_id:
            return
        async with self._lock:
            if image_id != self.image_id:
                await self._stop()
        raise ZygoteFailed("the image was rebuilt since the kernel zygote started; it starts again")

    async def _spawn(self) -> socket.socket:
        where = self.home / secrets.token_hex(6)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await asyncio.to_thread(where.mkdir, 0o700, True)
            listener.bind(str(where / SOCKET_NAME))
            listener.listen(1)
            listener.setblocking(False)
            try:
                self.container = await asyncio.to_thread(
                    self.client.containers.run, **self._options(where)
                )
            except (DockerException, RequestException) as exc:
                raise ZygoteFailed(f"the engine did not start the kernel zygote: {exc}") from None
            try:
                connection, _ = await asyncio.wait_for(
                    asyncio.get_running_loop().sock_accept(listener), START_TIMEOUT_S
                )
            except TimeoutError:
                raise ZygoteFailed("the kernel zygote's container did not connect") from None
            try:
                await self._check_peer(connection)
            except BaseException:
                connection.close()
                raise
            return connection
        finally:
            listener.close()  # one connection, the container's: nobody else's is taken
            await asyncio.to_thread(shutil.rmtree, where, True)

    async def _check_peer(self, connection: socket.socket) -> None:
        """The connection is the container's own process's (its host pid: it shares the
        host's PID namespace)."""
        pid, _, _ = _UCRED.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        try:
            await asyncio.to_thread(self.container.reload)
        except (DockerException, RequestException) as exc:
            raise ZygoteFailed(f"the kernel zygote's container cannot be read: {exc}") from None
        if pid != int(self.container.attrs.get("State", {}).get("Pid") or -1):
            raise ZygoteFailed("a process other than the kernel zygote's connected")
        self.image_id = str(self.container.attrs.get("Image") or "")

    def _options(self, where: Path) -> dict[str, Any]:
        env = kernel_environment(
            path=self.kernel_path, home="/tmp", limits=ResourceLimits(), extra={}
        )
        script = f"{DIR_IN_CONTAINER}/{ZYGOTE_FILE.name}"
        connect = f"{SOCKET_DIR_IN_CONTAINER}/{SOCKET_NAME}"
        return {
            "image": self.image,
            # Its program, never the image's entrypoint (which would run with its privileges).
            "entrypoint": [self.python],
            "command": [script, "--connect", connect],
            "name": f"code-interpreter-zygote-{self.orchestrator_id}-{secrets.token_hex(4)}",
            "user": "0:0",
            "environment": env | SINGLE_THREADED,
            "working_dir": "/",
            "labels": {
                LABEL_ZYGOTE: self.image,
                LABEL_ORCHESTRATOR: self.orchestrator_id,
                **ProcessIdentity.of_this_process().labels(LABEL_OWNER),
            },
            "pid_mode": "host",
            "network_mode": "none",
            "read_only": True,
            "tmpfs": {"/tmp": "rw,nosuid,nodev,size=256m,mode=1777"},
            "volumes": {
                str(ZYGOTE_FILE): {"bind": script, "mode": "ro"},
                str(COMMAND_SERVER_FILE): {
                    "bind": f"{DIR_IN_CONTAINER}/{COMMAND_SERVER_FILE.name}",
                    "mode": "ro",
                },
                str(where): {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "rw"},
            },
            "cap_drop": ["ALL"],
            "cap_add": CAPABILITIES,
            "security_opt": ["no-new-privileges"],
            "runtime": "runc",
            "mem_limit": MEMORY,
            "memswap_limit": MEMORY,
            "pids_limit": PIDS,
            "log_config": LogConfig(
                type=LogConfig.types.JSON, config={"max-size": "256k", "max-file": "1"}
            ),
            "stdin_open": False,
            "detach": True,
        }

    def _running(self) -> bool:
        """Its connection still open at its end (a zygote that died hung it up)."""
        if self._connection is None or self.container is None:
            return False
        poller = select.poll()
        poller.register(self._connection, select.POLLHUP | select.POLLERR)
        return not poller.poll(0)

    async def _kill(self) -> None:
        container, self.container = self.container, None
        self.image_id = ""
        if container is not None:
            await remove_container(container)

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, self.home, True)
