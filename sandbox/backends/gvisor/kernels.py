"""A machine's kernels: started by its agent, reached through it.

The kernel binds its ZeroMQ ipc sockets inside the machine (in /run, saved with it). The host
keeps Unix sockets of its own at the paths the driver's connection info names, and relays each
connection made there to the kernel's socket inside, over the agent's channel. After a restore
the driver's ZeroMQ sockets simply connect again. A kernel that was running when its machine
was saved is taken over (`KeptKernel`) instead of started: same process, same key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.gvisor.agent_channel import AgentChannel, ChannelStream, bridge
from sandbox.kernel.command import kernel_environment
from sandbox.kernel.process import KernelExit
from sandbox.kernel.programs import INTERRUPT_SOCKET, KernelPrograms, language_environment

log = logging.getLogger(__name__)

KERNELS_IN_SANDBOX = "/run/kernel"
_SOCKETS = (1, 2, 3, 4, 5)
MAX_RELAYED = 32  # connections at once to one kernel socket (a driver makes one each)
_CONNECT_WAIT_S = 60.0  # for the kernel to bind its sockets after its start
_DIAGNOSTICS_BYTES = 8 << 10
KERNEL_TAG = "kernel:"
# Tells Python's start-up file where its forked children's output pipe goes (startup.py).
IOPUB_PIPE_ENV = "CIR_IOPUB_PIPE"


@dataclass(frozen=True)
class KeptKernel:
    """A kernel that was running when its machine was saved: its pid, where its sockets are
    inside, and the key it signs with."""

    pid: int
    prefix_in_sandbox: str
    key: str

    def as_json(self) -> dict[str, object]:
        return {"pid": self.pid, "prefix": self.prefix_in_sandbox, "key": self.key}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> KeptKernel:
        return cls(int(str(data["pid"])), str(data["prefix"]), str(data["key"]))


class OutputMoved:
    """When the relay of a kernel's iopub last handed bytes to the driver's socket.

    A large message crosses the agent's channel far slower than a Unix socket (a 200 MB print
    takes seconds under load) while the run's reply, on the shell socket, overtakes it: the
    driver counts these bytes as output still coming, not as the quiet that ends a run."""

    def __init__(self) -> None:
        self.at = 0.0  # time.monotonic(); 0: never

    def mark(self) -> None:
        self.at = time.monotonic()


class MachineKernel:
    """A kernel process in a machine, as the driver sees it (a `KernelProcess`)."""

    def __init__(
        self,
        channel: AgentChannel,
        pid: int,
        relays: list[asyncio.Server],
        output: ChannelStream | None,
        kept: KeptKernel,
        hit_memory_limit: Callable[[], bool | None],
        iopub_moved: OutputMoved | None = None,
    ) -> None:
        self.channel = channel
        self._hit_memory_limit = hit_memory_limit
        self.pid = pid
        self.kept = kept
        self._relays = relays
        self._iopub_moved = iopub_moved or OutputMoved()
        self._log = bytearray()
        self._reader = asyncio.ensure_future(self._read(output)) if output else None

    async def _read(self, output: ChannelStream) -> None:
        with contextlib.suppress(Exception):
            while data := await output.read():
                self._log += data
                del self._log[:-_DIAGNOSTICS_BYTES]

    async def wait(self) -> KernelExit:
        try:
            end = await self.channel.wait_child(self.pid)
        except Exception as exc:
            while self.channel.detached:  # being saved with its machine, not dead
                await self.channel.attached.wait()
            if self._hit_memory_limit():  # gVisor ends whole at the sandbox's memory limit
                return KernelExit.from_returncode(-signal.SIGKILL, out_of_memory=True)
            return KernelExit(f"was lost when its sandbox's machine ended ({exc})", None, None)
        if end.signal is not None:
            return KernelExit.from_returncode(-end.signal, out_of_memory=end.out_of_memory)
        return KernelExit.from_returncode(end.code or 0, out_of_memory=end.out_of_memory)

    async def kill(self) -> None:
        self.close_relays()
        if not self.channel.closed.done():
            with contextlib.suppress(Exception):
                await self.channel.signal(self.pid, signal.SIGKILL)
                await asyncio.wait_for(self.channel.wait_child(self.pid), 10)
        if self._reader is not None:
            self._reader.cancel()

    def close_relays(self) -> None:
        for server in self._relays:
            server.close()

    def diagnostics(self) -> str:
        return self._log.decode(errors="replace")

    def output_moved(self) -> float:
        """When iopub bytes last reached the driver through our relay (time.monotonic())."""
        return self._iopub_moved.at


class MachineKernelLauncher:
    """Starts (or takes over) the kernel of one language in a machine."""

    def __init__(
        self,
        channel: Callable[[], Awaitable[AgentChannel]],
        spec: SandboxSpec,
        kernel_dir: Path,
        language: str,
        kernels: KernelPrograms,
        uid: int,
        *,
        kernel_path: str,
        environment: Callable[[], dict[str, str]],
        hit_memory_limit: Callable[[], bool | None],
        kept: KeptKernel | None = None,
    ) -> None:
        self._hit_memory_limit = hit_memory_limit
        self._channel = channel
        self.spec = spec
        self._kernel_dir = kernel_dir
        self.language = language
        self.kernels = kernels
        self.uid = uid
        self.kernel_path = kernel_path
        self.environment = environment
        self.kept = kept  # taken over at the first launch
        self.current: MachineKernel | None = None

    @property
    def kernel_dir(self) -> Path:
        return self._kernel_dir

    @property
    def kernel_dir_in_sandbox(self) -> str:
        # A fresh directory per start: what an earlier kernel left there is not in the way.
        return f"{KERNELS_IN_SANDBOX}/{self.language}"

    @property
    def kernel_uid(self) -> int | None:
        return None  # the host side holds only our relays' sockets

    def kept_key(self) -> str | None:
        """The key the next launch must sign with: a kept kernel's own."""
        return None if self.kept is None else self.kept.key

    async def launch(self, connection_file_in_sandbox: str) -> MachineKernel:
        channel = await self._channel()
        name = Path(connection_file_in_sandbox).name
        info = json.loads((self._kernel_dir / name).read_text())
        host_prefix = Path(str(info["ip"])).name  # the driver's: k<generation>
        output: ChannelStream | None = None
        if self.kept is not None:
            kept, self.kept = self.kept, None
            pid = kept.pid
            output, _ = await channel.adopt(pid, stderr=False)
        else:
            limits = self.spec.limits
            env = kernel_environment(
                path=self.kernel_path,
                home="/tmp",
                limits=limits,
                extra={
                    **language_environment(self.language),
                    **self.environment(),
                    IOPUB_PIPE_ENV: f"{self.kernel_dir_in_sandbox}/iopub-pipe",
                },
            )
            argv = self.kernels.command(
                self.language, connection_file_in_sandbox, self.kernel_dir_in_sandbox, limits
            )
            data = (self._kernel_dir / name).read_bytes()
            pid, output, _ = await channel.spawn(
                argv,
                env=env,
                cwd=self.spec.workdir,
                uid=self.uid,
                gid=self.uid,
                tag=f"{KERNEL_TAG}{self.language}",
                marker=secrets.token_hex(12),
                separate_stderr=False,
                files={connection_file_in_sandbox: (data, 0o600)},
            )
            inside = f"{self.kernel_dir_in_sandbox}/{host_prefix}"
            kept = KeptKernel(pid, inside, str(info["key"]))
        iopub_moved = OutputMoved()
        iopub = f"{host_prefix}-{int(info['iopub_port'])}"
        relays = await self._relay(
            channel, host_prefix, kept.prefix_in_sandbox, {iopub: iopub_moved.mark}
        )
        self.current = MachineKernel(
            channel, pid, relays, output, kept, self._hit_memory_limit, iopub_moved
        )
        return self.current

    async def _relay(
        self,
        channel: AgentChannel,
        host_prefix: str,
        inside_prefix: str,
        watched: dict[str, Callable[[], None]],
    ) -> list[asyncio.Server]:
        """Host sockets named as the driver expects, each relayed to the kernel's inside;
        `watched[name]()` is called as bytes from inside reach the driver on socket `name`."""
        pairs = [(f"{host_prefix}-{n}", f"{inside_prefix}-{n}") for n in _SOCKETS]
        inside_dir = str(Path(inside_prefix).parent)
        pairs.append((INTERRUPT_SOCKET, f"{inside_dir}/{INTERRUPT_SOCKET}"))
        servers = []
        try:
            for host_name, inside in pairs:
                path = self._kernel_dir / host_name
                moved = watched.get(host_name)
                servers.append(await _relay_server(channel, path, inside, moved))
        except BaseException:
            for server in servers:
                server.close()
            raise
        return servers


async def _relay_server(
    channel: AgentChannel, path: Path, inside: str, moved: Callable[[], None] | None = None
) -> asyncio.Server:
    slots = asyncio.Semaphore(MAX_RELAYED)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if slots.locked():
            writer.close()
            return
        async with slots:
            stream = await _connect_when_bound(channel, inside)
            if stream is None:
                writer.close()
                return
            await bridge(stream, reader, writer, moved)

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket of the kernel's generation before
    server = await asyncio.start_unix_server(relay, path=str(path))
    os.chmod(path, 0o600)
    return server


async def _connect_when_bound(channel: AgentChannel, inside: str) -> ChannelStream | None:
    """A connection to `inside`, waiting for the kernel to bind it (it is starting)."""
    delay, waited = 0.02, 0.0
    while not channel.closed.done():
        try:
            return await channel.connect(inside)
        except Exception:
            if waited >= _CONNECT_WAIT_S:
                return None
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.25)
    return None
