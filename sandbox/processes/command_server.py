"""The host's end of a sandbox's command server (`inside_kernel/command_server.py`): one
connection, over which commands are handed over with their descriptors and their ends come back.

How a server is started is its backend's (`local_command_server.py`: nsenter into a bubblewrap
sandbox; `docker_command_server.py`: an exec in a container); what follows is the same for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError
from sandbox.host_commands import memfd_with

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a server that takes no command for this long is stopped or wedged
HOLDER_EXIT_S = 2.0  # for a server's holder to end once the server was told to, or killed
# The end given to a command whose server ended before it did: its own is not known to the
# server any more (it lives on, reparented); its spawner follows it by a pidfd instead.
SERVER_GONE = -(1 << 16)
MESSAGE_LIMIT = 1 << 12  # the most one message from a server may hold
# A send failing with one of these found the server gone; any other refused this one message.
_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF}


class ServerGone(SandboxStartError):
    """The server ended (killed from inside, or with its sandbox) before it took a command."""


@dataclass(frozen=True)
class CommandFds:
    """What a command's process is given, in this order: its stdin, stdout, stderr, and the
    control socket of its start (`served_spawner.handshake`)."""

    stdin: int
    stdout: int
    stderr: int
    control: int


class CommandServer:
    """A running server: sends it commands, and resolves each one's end as the server tells it
    (an exit status, or -signal, as asyncio's `returncode`)."""

    def __init__(
        self,
        connection: socket.socket,
        *,
        serves: int | str | None,
        host_pid: int | None = None,
        proc: asyncio.subprocess.Process | None = None,
    ) -> None:
        """`serves`: which sandbox it runs in (a local sandbox's init, a container's name, None
        for no sandbox); `host_pid`: its pid on the host, the parent of every command it forks,
        where the host sees it; `proc`: the host's process that holds it, killed with it."""
        self.serves = serves
        self.host_pid = host_pid
        self._proc = proc
        self._connection = connection
        self._ends: dict[int, asyncio.Future[int]] = {}
        self._next_id = 0
        self._sending = asyncio.Lock()
        self._wedged = False
        self._reader = asyncio.ensure_future(self._read())

    @property
    def alive(self) -> bool:
        return not self._reader.done() and not self._wedged

    def wedged(self) -> None:
        """It stopped taking commands or starting them (code in the sandbox can stop it): the
        next command replaces it."""
        self._wedged = True

    def expect(self) -> tuple[int, asyncio.Future[int]]:
        """A new command's id and the future of its end, made before it is sent (its end can
        come before the sender hears of its start)."""
        self._next_id += 1
        end: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if not self.alive:
            end.set_result(SERVER_GONE)
        self._ends[self._next_id] = end
        return self._next_id, end

    def forget(self, command: int) -> None:
        """A command that never started: no end will come for it."""
        self._ends.pop(command, None)

    async def send(self, command: int, spec: dict[str, object], fds: CommandFds) -> None:
        """Hand it a command: its JSON (any size) in a memfd, the descriptors it gets."""
        spec_fd = memfd_with("command", json.dumps(spec).encode())
        try:
            descriptors = [fds.stdin, fds.stdout, fds.stderr, fds.control, spec_fd]
            await self._send({"id": command}, descriptors)
        finally:
            os.close(spec_fd)

    async def kill(self, command: int) -> None:
        """Kill a command whose start was given up (best effort: it may have ended)."""
        with contextlib.suppress(SandboxStartError):
            await self._send({"kill": command}, [])

    async def signal(self, command: int, signum: int, marker: str) -> None:
        """Signal a command's group while it runs, and every process whose environment holds
        `marker` (NAME=VALUE): what it started. Nothing, once the server is gone."""
        with contextlib.suppress(SandboxStartError):
            await self._send({"signal": command, "signum": signum, "marker": marker}, [])

    async def _send(self, message: dict[str, object], descriptors: list[int]) -> None:
        loop = asyncio.get_running_loop()
        data = json.dumps(message).encode()
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S), self._sending:
                while True:
                    try:
                        socket.send_fds(self._connection, [data], descriptors)
                        return
                    except BlockingIOError:
                        writable = loop.create_future()
                        loop.add_writer(self._connection, writable.set_result, None)
                        try:
                            await writable
                        finally:
                            loop.remove_writer(self._connection)
        except TimeoutError:
            self.wedged()
            raise ServerGone("the sandbox's command server took no command in time") from None
        except OSError as exc:
            if exc.errno in _GONE:
                raise ServerGone(
                    "the sandbox's command server has ended (its kernel is restarting or "
                    "the sandbox is closing); try again in a moment"
                ) from exc
            raise SandboxStartError(f"the process could not be handed over: {exc}") from exc

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while said := await loop.sock_recv(self._connection, MESSAGE_LIMIT):
                try:
                    told = json.loads(said)
                    command, code = int(told["exited"]), int(told["code"])
                except (ValueError, KeyError, TypeError):
                    log.warning("the command server of sandbox %s said nonsense", self.serves)
                    break
                end = self._ends.pop(command, None)
                if end is not None and not end.done():
                    end.set_result(code)
                await asyncio.sleep(0)  # a server that never stops talking holds no loop
        except OSError:
            pass
        finally:
            # Gone: its commands live on, or ended unseen.
            for end in self._ends.values():
                if not end.done():
                    end.set_result(SERVER_GONE)
            self._ends.clear()
            self._connection.close()
            if self._proc is not None:
                await self._end_holder(self._proc)

    async def _end_holder(self, proc: asyncio.subprocess.Process) -> None:
        """The host's process that holds the server (nsenter) ends once the server has: it
        reaps it. Killed first, it would orphan the server to whatever reaps for this service,
        and a zombie of the sandbox's PID namespace held there keeps that namespace's init from
        ending. So the server goes first: it ends by itself once its connection is closed, and is
        killed if it does not (stopped, say)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), HOLDER_EXIT_S)
        if proc.returncode is None and self.host_pid is not None and self.host_pid != proc.pid:
            await asyncio.to_thread(_kill_child, proc.pid, self.host_pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), HOLDER_EXIT_S)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()

    async def close(self) -> None:
        """End it (and, with it, whatever it still runs)."""
        with contextlib.suppress(OSError):
            self._connection.shutdown(socket.SHUT_RDWR)
        await asyncio.shield(self._reader)


def _kill_child(parent: int, pid: int) -> None:
    """SIGKILL `pid` if it is still `parent`'s child (pinned by a pidfd: never a reused pid)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        with open(f"/proc/{pid}/status") as status:
            ppid = next((line.split()[1] for line in status if line.startswith("PPid:")), "")
        if ppid == str(parent):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def child_with_pid(parent: int, sandbox_pid: int) -> int:
    """The host pid of `parent`'s child whose pid in its sandbox is `sandbox_pid`."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:  # the parent (a command server) is gone
        children = []
    for child in children:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(sandbox_pid):
                    return int(child)
    raise SandboxStartError("the process that entered the sandbox could not be found")
