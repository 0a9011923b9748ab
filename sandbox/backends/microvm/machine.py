"""One QEMU machine: its process, confined (qemu.py), and the channel to its agent over a
virtio-serial port, which QEMU binds to a Unix socket in the session's directory.

It offers what the gVisor backend's machine does (the sandbox and its kernels, processes and
channels are the same code, sandbox/backends/gvisor/): start or restore, a fresh start when
it ended on its own, a whole save that stops it or runs on, destroy. A save is QEMU's
migration of the stopped machine into a file (monitor.py); its disks are copied beside it by
the caller while the machine is still stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import secrets
import shutil
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from code_interpreter_wire.errors import SandboxClosed, SandboxError
from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.gvisor import machine as gvisor_machine
from sandbox.backends.gvisor.agent_channel import (
    AcceptHandler,
    AgentChannel,
    AgentError,
    save_and_go_on,
)
from sandbox.backends.microvm.guest_boot import READY_MARK
from sandbox.backends.microvm.guest_channels import run_as_root
from sandbox.backends.microvm.guest_disks import copy_disk
from sandbox.backends.microvm.monitor import Monitor, MonitorError
from sandbox.backends.microvm.qemu import Accelerator, MachineLayout, command_line
from sandbox.cgroups import SandboxCgroup
from sandbox.run_to_end import finish_even_if_cancelled

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 180.0  # TCG on a loaded host boots slowly; a hang ends here
QEMU_THREADS = 128  # its pids limit: vCPUs, its I/O pool (qemu.IO_THREADS), its own
_TAIL_BYTES = 4096
WATCHDOG_MISSES = 3  # asks in a row, each waiting up to a period for its answer
DROP_CACHES_TIMEOUT_S = 20.0
UNSHARE = "/usr/bin/unshare"  # util-linux's, at its fixed place
STATE_SLACK_MB = 1024  # a save's state beside the guest's memory: its devices, its headers
STATE_FILE = "state"  # a saved machine's memory and devices, in its image directory


class MachineError(gvisor_machine.MachineError):
    """QEMU refused or failed (the message holds its own words or the guest's last); the
    machine sandbox's code (shared with gVisor) takes it as a failed save or start."""


class RestoreFailed(MachineError, gvisor_machine.RestoreFailed):
    """A machine saved while it ran could not run on from the save."""


class QemuMachine:
    """One QEMU process and the channel to its agent."""

    def __init__(
        self,
        program: str,
        accelerator: Accelerator,
        layout: MachineLayout,
        limits: ResourceLimits,
        name: str,
        *,
        root_allowed: bool = True,
        cgroups: bool = True,
        hang_timeout_s: float = 90.0,
    ) -> None:
        self.program = program
        self.accelerator = accelerator
        self.layout = layout
        self.limits = limits
        self.id = name
        self.root_allowed = root_allowed
        self.hang_timeout_s = hang_timeout_s  # a machine silent this long is ended
        self.channel: AgentChannel | None = None
        self.restarts = 0
        self.stderr_tail = b""  # the serial console's last and QEMU's own words
        self._process: asyncio.subprocess.Process | None = None
        self._drainer: asyncio.Task[None] | None = None
        self._booted = asyncio.Event()
        self._closed = False
        self._on_accept: AcceptHandler | None = None
        self._starting = asyncio.Lock()
        self._group = SandboxCgroup(f"vm-{name}") if cgroups else None
        self._qmp: Monitor | None = None
        self._watchdog: asyncio.Future[None] | None = None
        self._oom_kills_at_start = 0  # the host's OOM kills in its cgroup before this QEMU
        self.on_destroyed: Callable[[], None] | None = None  # gives its host uid back
        # What a machine booted afresh after its predecessor ended needs done first.
        self.after_restart: Callable[[AgentChannel], Awaitable[None]] | None = None

    # --- the process --------------------------------------------------------------------------
    async def _launch(self, incoming: bool) -> socket.socket:
        """QEMU started (to restore, if `incoming`: it then waits for its state); the agent's
        socket, connected (QEMU waits for that connection before the guest runs)."""
        for path in (self.layout.agent_socket, self.layout.monitor_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.layout.chroot.mkdir(mode=0o555, exist_ok=True)
        argv = command_line(self.program, self.accelerator, self.layout)
        if incoming:
            argv += ["-incoming", "defer"]
        if self._group is not None:
            reserve = self.limits.model_copy(
                update={
                    "memory_mb": self.layout.memory_mb + self.accelerator.own_memory_mb,
                    "pids": QEMU_THREADS,
                }
            )
            await asyncio.to_thread(self._group.create, reserve)
        self._booted = asyncio.Event()
        self.stderr_tail = b""
        if self._group is not None:
            self._oom_kills_at_start = self._group.oom_kills()
        largest = max(
            os.stat(disk).st_size for disk in (self.layout.root_layer, self.layout.workspace)
        )
        file_size = max(largest, (self.layout.memory_mb + STATE_SLACK_MB) << 20)
        process = await asyncio.create_subprocess_exec(
            # Namespaces of its own: no network but a loopback of its own, no host IPC or
            # abstract socket; its sockets here are files in the session's directory.
            UNSHARE,
            "--net",
            "--ipc",
            "--uts",
            "--",
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_qemu_limits, file_size),
        )
        self._process = process
        if self._group is not None:
            for directory in self._group.dirs:
                (directory / "cgroup.procs").write_text(str(process.pid))
        self._drainer = asyncio.ensure_future(self._drain(process))
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            if process.returncode is not None:
                await asyncio.wait_for(asyncio.shield(self._drainer), 5.0)
                raise MachineError(f"QEMU ended at its start: {self.last_words()}")
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, str(self.layout.agent_socket))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
            if time.monotonic() > deadline:
                await self._kill()
                raise MachineError("QEMU did not open its agent's socket in time")
            await asyncio.sleep(0.01)

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        """Its console, read for its life, only the last of it kept."""
        assert process.stdout is not None
        mark = READY_MARK.encode()
        while chunk := await process.stdout.read(1 << 14):
            seen = self.stderr_tail + chunk
            if mark in seen:
                self._booted.set()
            self.stderr_tail = seen[-_TAIL_BYTES:]

    def last_words(self) -> str:
        """What the guest and QEMU said last (the reason a machine ended or did not start)."""
        lines = self.stderr_tail.decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-6:])[-1500:] or "it said nothing"

    async def _wait_booted(self) -> None:
        process = self._process
        assert process is not None and self._drainer is not None
        booted = asyncio.ensure_future(self._booted.wait())
        try:
            done, _ = await asyncio.wait(
                {booted, self._drainer}, timeout=BOOT_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            booted.cancel()
        if self._booted.is_set():
            return
        why = "did not boot in time" if not done else "ended while booting"
        await self._kill()
        raise MachineError(f"the machine {why}: {self.last_words()}")

    async def _kill(self) -> None:
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
            self._watchdog = None
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            with contextlib.suppress(Exception):
                await qmp.close()
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        if self._drainer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._drainer), 5.0)

    # --- what the sandbox asks ----------------------------------------------------------------
    async def start(self, on_accept: AcceptHandler, *, image: Path | None = None) -> AgentChannel:
        """Boot the machine (or restore it from the save in `image`, its disks copied from
        there first); its agent's channel."""
        self._on_accept = on_accept
        if image is not None:
            await asyncio.to_thread(self._disks_from, image)
        sock = await self._launch(incoming=image is not None)
        try:
            if image is not None:
                await self._load(image)
            else:
                await self._wait_booted()
        except BaseException:
            sock.close()
            await self._kill()
            raise
        self.channel = await AgentChannel.over_socket(sock, on_accept)
        self.channel.root_allowed = self.root_allowed
        self.channel.hello_fields = _fresh_clock_and_entropy
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.ensure_future(self._watch(self.channel))
        return self.channel

    async def _watch(self, channel: AgentChannel) -> None:
        """A machine whose agent stops answering (its kernel hung, or QEMU stuck) is ended
        after WATCHDOG_MISSES asks in a row (about `hang_timeout_s`): its channel closes, the
        calls waiting on it fail typed, and the next call starts a fresh machine (`running`)."""
        period = self.hang_timeout_s / (2 * WATCHDOG_MISSES)
        missed = 0
        while not channel.closed.done():
            await asyncio.sleep(period)
            if channel.detached or channel.going_on or self._starting.locked():
                missed = 0
                continue  # being saved: it answers again after
            try:
                await asyncio.wait_for(channel.request("unsaveable"), period)
                missed = 0
            except (AgentError, TimeoutError):
                missed += 1
                log.warning("machine %s: its agent did not answer (%d)", self.id, missed)
            except SandboxError:
                return
            if missed >= WATCHDOG_MISSES:
                log.warning("machine %s stopped answering; it is ended", self.id)
                process = self._process
                if process is not None and process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                return

    def _disks_from(self, image: Path) -> None:
        for disk in (self.layout.root_layer, self.layout.workspace):
            with contextlib.suppress(FileNotFoundError):
                disk.unlink()
            copy_disk(image / disk.name, disk)

    async def _monitor(self) -> Monitor:
        if self._qmp is None:
            self._qmp = await Monitor.connect(self.layout.monitor_socket)
        return self._qmp

    async def _load(self, image: Path) -> None:
        try:
            await (await self._monitor()).load_from(image / STATE_FILE)
        except MonitorError as exc:
            await self._kill()
            raise MachineError(f"{exc} ({self.last_words()})") from None

    async def _save(self, image: Path) -> None:
        """The stopped machine's state and disks into `image` (a new directory); it stays
        stopped (QEMU has flushed and let go of its disks)."""
        os.mkdir(image, 0o700)
        try:
            await (await self._monitor()).save_to(image / STATE_FILE)
        except MonitorError as exc:
            raise MachineError(f"the machine could not be saved: {exc}") from None
        try:
            for disk in (self.layout.root_layer, self.layout.workspace):
                await asyncio.to_thread(copy_disk, disk, image / disk.name)
        except OSError as exc:  # the host's disk is full, say: the machine runs on unsaved
            raise MachineError(f"the machine's disks could not be copied: {exc}") from None

    async def running(self) -> AgentChannel:
        """Its agent's channel; a machine that ended on its own (a guest kernel's panic, most
        often) is booted again first, fresh: the session goes on with its workspace."""
        channel = self.channel
        if channel is not None and not channel.closed.done() and not channel.detached:
            return channel
        async with self._starting:
            channel = self.channel
            if channel is not None and not channel.closed.done() and not channel.detached:
                return channel
            if self._closed or channel is None or channel.detached or self._on_accept is None:
                raise SandboxClosed("the sandbox's machine is closed")
            log.warning(
                "machine %s ended on its own (%s); starting a new one", self.id, self.last_words()
            )
            await self._kill()
            channel = await self.start(self._on_accept)
            await channel.hello()
            if self.after_restart is not None:
                await self.after_restart(channel)
            self.restarts += 1
            return channel

    def hit_memory_limit(self) -> bool | None:
        """Whether the host's OOM killer ended QEMU itself (the guest's own OOM killer ends a
        process inside, which its kernel's end tells); None where unreadable."""
        if self._group is None:
            return None
        return self._group.oom_kills() > self._oom_kills_at_start

    async def checkpoint(self, image: Path) -> None:
        """Save the whole machine to `image` (a new directory); the machine stops. If the save
        fails, the machine runs on, its agent quiet until `AgentChannel.reattach`. Finished
        even if its caller leaves: a machine half saved would be neither running nor saved."""
        channel = self.channel
        assert channel is not None
        await _drop_caches(channel)
        await finish_even_if_cancelled(self._checkpoint(channel, image))

    async def _checkpoint(self, channel: AgentChannel, image: Path) -> None:
        await channel.detach()
        await self._save_or_resume(image)
        await self._kill()

    async def _save_or_resume(self, image: Path) -> None:
        """Save the machine into `image`; if that fails, it runs on (its agent still quiet)."""
        try:
            await self._save(image)
        except BaseException:
            with contextlib.suppress(MonitorError):
                await (await self._monitor()).resume()
            raise

    async def checkpoint_and_go_on(
        self, image: Path, while_stopped: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Save the whole machine to `image` (a new directory) and run on: the same QEMU, its
        agent told to talk again. `while_stopped` runs between the two; its failure is raised
        once the machine runs again. A failed save is the caller's to `reattach` after; a
        machine that does not run on leaves the channel closed (`running` starts anew)."""
        channel = self.channel
        assert channel is not None

        await save_and_go_on(
            channel, self._starting, lambda: self._save_and_resume(channel, image, while_stopped)
        )

    async def _save_and_resume(
        self,
        channel: AgentChannel,
        image: Path,
        while_stopped: Callable[[], Awaitable[None]] | None,
    ) -> None:
        await _drop_caches(channel)
        await channel.detach()
        await self._save_or_resume(image)
        failure: Exception | None = None
        if while_stopped is not None:
            try:
                await while_stopped()
            except Exception as exc:
                failure = exc
        try:
            await (await self._monitor()).resume()
            await channel.reattach()
        except (MonitorError, AgentError) as exc:
            await channel.close()
            channel.not_detached()
            raise RestoreFailed(f"the machine was saved, then did not run on: {exc}") from exc
        if failure is not None:
            raise failure

    async def destroy(self) -> None:
        """Kill QEMU; safe to call twice."""
        self._closed = True
        async with self._starting:
            if self.channel is not None:
                await self.channel.close()
            await self._kill()
            if self._group is not None:
                await asyncio.to_thread(self._group.remove)
        for path in (self.layout.agent_socket, self.layout.monitor_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.layout.chroot)
        if self.on_destroyed is not None:
            done, self.on_destroyed = self.on_destroyed, None
            done()


async def _drop_caches(channel: AgentChannel) -> None:
    """The guest's page cache let go before a save (less for the save to write); given up
    after DROP_CACHES_TIMEOUT_S (a guest may not answer: the save goes on)."""
    with contextlib.suppress(AgentError, SandboxError, TimeoutError):
        async with asyncio.timeout(DROP_CACHES_TIMEOUT_S):
            await _run_drop_caches(channel)


async def _run_drop_caches(channel: AgentChannel) -> None:
    await run_as_root(channel, ["/bin/sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"])


def _qemu_limits(file_size: int) -> None:
    """In QEMU's process, before it runs: no file it writes (its disks, a save's state)
    grows past what its machine can need, and no core dump of a guest's memory."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _fresh_clock_and_entropy() -> dict[str, object]:
    """What each hello gives the guest: the time now (a restored machine wakes with its
    save's) and entropy its kernel reseeds from (forks of one save would draw alike)."""
    return {"now": time.time(), "entropy": secrets.token_hex(32)}
