"""One VM's QEMU monitor (QMP): run state, and whole-VM saves and restores through files.

A save is QEMU's migration into a file, a restore the same stream into a new QEMU started with
`-incoming defer`. QEMU runs confined (`-sandbox ...,spawn=deny`, an unprivileged uid), so it
neither runs `exec:` helpers nor opens our files: we open them and pass the descriptor over the
monitor's socket (SCM_RIGHTS, `getfd`), then migrate to or from `fd:<name>`. Disk images are not
in the stream; the caller copies them while the VM is stopped.

QEMU 7.2 throttles a migration to 32 MiB/s unless told otherwise, and iterates over RAM as if the
guest were running; a save here is always of a stopped VM, so the limit is lifted and the whole
state goes in one pass (`_FILE_PARAMETERS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from qemu.qmp import EventListener, ExecuteError, QMPClient, QMPError

from code_interpreter_wire.errors import SandboxError

CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 10.0
SAVE_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 120.0
# What a state file starts with: QEMU_VM_FILE_MAGIC, then QEMU_VM_FILE_VERSION (3).
STATE_FILE_HEADER = b"QEVM\x00\x00\x00\x03"
# Lift the bandwidth limit (7.2's default: 32 MiB/s) and allow any "downtime" (the VM is stopped
# already), so QEMU writes RAM once and completes instead of iterating; 2,000 s is QEMU's maximum.
_FILE_PARAMETERS: Mapping[str, object] = {
    "max-bandwidth": 1 << 40,
    "downtime-limit": 2_000_000,
}
_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.05
_SETTLED = {"completed", "failed", "cancelled"}


class MonitorError(SandboxError):
    """QEMU's monitor refused a command, did not answer in time, or went away (QEMU exited)."""


class MigrationFailed(MonitorError):
    """A save or restore of the VM's state failed; the message carries QEMU's reason."""


class Monitor:
    """The QMP connection to one VM's QEMU; every wait is bounded by a timeout."""

    def __init__(self, client: QMPClient, path: Path) -> None:
        self._client = client
        self._path = path
        self._fd_names = itertools.count()
        self._events_on = False

    @classmethod
    async def connect(
        cls, path: str | os.PathLike[str], *, timeout_s: float = CONNECT_TIMEOUT_S
    ) -> Self:
        """Connect to QEMU's QMP socket, waiting for QEMU to create it (it may be starting)."""
        socket_path = Path(path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: BaseException | None = None
        while True:
            if not await asyncio.to_thread(socket_path.exists):  # the library logs a failure
                if loop.time() >= deadline:
                    raise MonitorError(f"no QMP monitor at {socket_path} within {timeout_s}s")
                await asyncio.sleep(0.01)
                continue
            client = QMPClient(f"qmp:{socket_path.name}")
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.001)):
                    await client.connect(str(socket_path))
                return cls(client, socket_path)
            except TimeoutError as error:
                last = error
            except (QMPError, OSError) as error:
                last = error
            with contextlib.suppress(Exception):
                await client.disconnect()
            if loop.time() >= deadline:
                raise MonitorError(f"no QMP monitor at {socket_path} within {timeout_s}s: {last}")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Drop the connection (QEMU runs on); an error of the connection's end is moot here."""
        with contextlib.suppress(Exception):
            await self._client.disconnect()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def execute(
        self,
        command: str,
        arguments: Mapping[str, object] | None = None,
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> object:
        """One QMP command's return value; any failure as MonitorError."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._client.execute(command, arguments)
        except ExecuteError as error:
            raise MonitorError(f"QEMU refused {command}: {error}") from error
        except TimeoutError as error:
            raise MonitorError(f"QEMU did not answer {command} within {timeout_s}s") from error
        except (QMPError, OSError, EOFError) as error:
            await self.close()  # collects the connection's own end, or asyncio logs it
            raise MonitorError(
                f"QEMU's monitor at {self._path} is gone ({command}): {error}"
            ) from error

    async def status(self, *, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """QEMU's run state: running, paused, inmigrate, postmigrate, shutdown..."""
        reply = await self.execute("query-status", timeout_s=timeout_s)
        return str(_as_dict(reply, "query-status")["status"])

    async def pause(self, *, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        """Stop the guest's CPUs (a no-op when they are stopped)."""
        await self.execute("stop", timeout_s=timeout_s)

    async def resume(self, *, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        """Run the guest's CPUs again (after a pause, a save or a restore)."""
        await self.execute("cont", timeout_s=timeout_s)

    async def quit(self, *, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        """Ask QEMU to exit; the caller reaps the process. Its connection closing is expected."""
        with contextlib.suppress(MonitorError):
            await self.execute("quit", timeout_s=timeout_s)
        await self.close()

    async def save_to(
        self, target: int | str | os.PathLike[str], *, timeout_s: float = SAVE_TIMEOUT_S
    ) -> int:
        """Stop the VM and write its whole state to `target`: the state's size in bytes.

        A path is written under a temporary name and renamed when complete and synced, so it is
        either the whole state or absent. A descriptor (open for writing, the caller's to close)
        is written from its offset and synced when it is a file. The VM stays stopped: the
        caller resumes it or quits."""
        if isinstance(target, int):
            await self._save_to_fd(target, timeout_s)
            return await asyncio.to_thread(_synced_size, target)
        return await self._save_to_path(Path(target), timeout_s)

    async def _save_to_path(self, path: Path, timeout_s: float) -> int:
        fd, partial = await asyncio.to_thread(
            tempfile.mkstemp, prefix=f".{path.name}.", suffix=".partial", dir=path.parent
        )
        try:
            await self._save_to_fd(fd, timeout_s)
            size = await asyncio.to_thread(_synced_size, fd)
            await asyncio.to_thread(_rename_synced, Path(partial), path)
            return size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        finally:
            os.close(fd)

    async def _save_to_fd(self, fd: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.pause()
                await self._prepare_migration()
                await self.execute("migrate-set-parameters", _FILE_PARAMETERS)
                name = await self._pass_fd(fd)
                await self._start("migrate", name)
                await self._migration_settled("save")
        except TimeoutError as error:
            # A migration blocked writing (a pipe nobody reads) stays "cancelling" until the
            # write returns: QEMU cannot shut down a file descriptor that is not a socket.
            state = "unknown"
            with contextlib.suppress(MonitorError):
                await self.execute("migrate_cancel")
                state = str(
                    _as_dict(await self.execute("query-migrate"), "query-migrate").get("status")
                )
            raise MigrationFailed(
                f"the save did not finish within {timeout_s}s (cancelled; the migration is {state})"
            ) from error

    async def load_from(
        self,
        source: int | str | os.PathLike[str],
        *,
        timeout_s: float = LOAD_TIMEOUT_S,
        resume: bool = True,
    ) -> None:
        """Restore a saved state into this QEMU (started with `-incoming defer` and the saved
        VM's very command line), then resume it unless told not to.

        A descriptor (a file, or a pipe from a decompressor) is read from its offset and stays
        the caller's. QEMU 7.2 exits when a
        state does not load (corrupt, truncated, another machine's): that is MigrationFailed,
        and QEMU's stderr says more."""
        if isinstance(source, int):
            await self._load_from_fd(source, timeout_s, resume)
            return
        try:
            fd = await asyncio.to_thread(os.open, source, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise MigrationFailed(f"cannot open the state file {source}: {error}") from error
        try:
            await self._load_from_fd(fd, timeout_s, resume)
        finally:
            os.close(fd)

    async def _load_from_fd(self, fd: int, timeout_s: float, resume: bool) -> None:
        header = await asyncio.to_thread(_peek, fd, len(STATE_FILE_HEADER))
        if header is not None and header != STATE_FILE_HEADER:
            raise MigrationFailed(f"not a QEMU state file (it starts {header!r})")
        try:
            async with asyncio.timeout(timeout_s):
                await self._prepare_migration()
                name = await self._pass_fd(fd)
                await self._start("migrate-incoming", name)
                await self._migration_settled("restore")
                await self._left_inmigrate()
        except TimeoutError as error:
            raise MigrationFailed(f"the restore did not finish within {timeout_s}s") from error
        except MigrationFailed:
            raise
        except MonitorError as error:
            raise MigrationFailed(
                f"the state did not load (QEMU exits on a corrupt, truncated or foreign state;"
                f" its stderr says why): {error}"
            ) from error
        if resume:
            await self.resume()

    async def _prepare_migration(self) -> None:
        """MIGRATION events on, so a wait wakes when the state changes rather than on a poll."""
        if not self._events_on:
            await self.execute(
                "migrate-set-capabilities",
                {"capabilities": [{"capability": "events", "state": True}]},
            )
            self._events_on = True

    async def _pass_fd(self, fd: int) -> str:
        """Hand QEMU a copy of `fd` (SCM_RIGHTS) under a fresh name for an `fd:` URI."""
        name = f"cir-state-{next(self._fd_names)}"
        try:
            self._client.send_fd_scm(fd)
        except (QMPError, OSError) as error:
            raise MonitorError(f"cannot pass a descriptor to QEMU: {error}") from error
        await self.execute("getfd", {"fdname": name})
        return name

    async def _start(self, command: str, fd_name: str) -> None:
        """`migrate` or `migrate-incoming` from the passed descriptor, which QEMU then owns."""
        try:
            await self.execute(command, {"uri": f"fd:{fd_name}"})
        except MonitorError:
            with contextlib.suppress(MonitorError):
                await self.execute("closefd", {"fdname": fd_name})
            raise

    async def _migration_settled(self, what: str) -> None:
        """Wait (the caller bounds it) for the migration to complete; MigrationFailed if not."""
        with self._client.listener("MIGRATION") as events:
            poll = _POLL_FIRST_S
            while True:
                info = _as_dict(await self.execute("query-migrate"), "query-migrate")
                state = str(info.get("status", ""))
                if state == "completed":
                    return
                if state in _SETTLED:
                    reason = info.get("error-desc", "no reason given")
                    raise MigrationFailed(f"the {what} {state}: {reason}")
                await _next_event(events, poll)
                poll = min(poll * 2, _POLL_MAX_S)

    async def _left_inmigrate(self) -> None:
        """After a restore completes, QEMU sets the run state in a bottom half: wait for it."""
        poll = _POLL_FIRST_S
        while await self.status() == "inmigrate":
            await asyncio.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)


async def _next_event(events: EventListener, wait: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait):
            await events.get()


def _as_dict(reply: object, command: str) -> dict[str, object]:
    if not isinstance(reply, dict):
        raise MonitorError(f"QEMU's answer to {command} is not an object: {reply!r}")
    return reply


def _peek(fd: int, size: int) -> bytes | None:
    """The next `size` bytes of a file, left unread; None for a pipe (no peeking there)."""
    try:
        return os.pread(fd, size, os.lseek(fd, 0, os.SEEK_CUR))
    except OSError as error:
        if error.errno == errno.ESPIPE:
            return None
        raise MigrationFailed(f"cannot read the state: {error}") from error


def _synced_size(fd: int) -> int:
    """Sync what QEMU wrote through its copy of `fd` (one open file): the file's size."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return 0
    os.fsync(fd)
    return os.fstat(fd).st_size


def _rename_synced(partial: Path, path: Path) -> None:
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
