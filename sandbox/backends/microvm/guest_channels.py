"""A machine's host-tool directory, copied in: a gVisor machine has it bound read-only, a
virtual machine can be bound nothing (a save could not hold it), so its files are written into
the machine's root: the kernel module with the root layer, the manifest (written by the service
once the session has its tools) pushed in through the agent as it is written."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import signal
from collections.abc import Awaitable, Callable

from code_interpreter_wire.errors import SandboxError
from sandbox.backends.gvisor.agent_channel import AgentChannel
from sandbox.host_channel import HOST_TOOLS_DIR_IN_SANDBOX, HostChannel

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 60.0
FILE_MODE = 0o644  # root's, readable by the sandbox's user, not its to change


def channel_files(channel: HostChannel) -> dict[str, bytes]:
    """The directory's files now, by their paths inside (for the machine's root layer)."""
    found = {}
    for path in sorted(channel.path.iterdir()):
        if path.is_file() and not path.is_symlink() and not path.name.startswith("."):
            found[posixpath.join(HOST_TOOLS_DIR_IN_SANDBOX, path.name)] = path.read_bytes()
    return found


def mirror_into(
    running: Callable[[], Awaitable[AgentChannel]], loop: asyncio.AbstractEventLoop
) -> Callable[[str, bytes], None]:
    """A `HostChannel` mirror that writes each file into the machine through its agent; run on
    a worker thread (`ToolChannel.open` writes there), it returns once the file is in."""

    async def push(name: str, data: bytes) -> None:
        async with asyncio.timeout(PUSH_TIMEOUT_S):
            await push_file(await running(), name, data)

    def mirror(name: str, data: bytes) -> None:
        if loop.is_closed():
            return
        future = asyncio.run_coroutine_threadsafe(push(name, data), loop)
        if _running_loop() is loop:  # on the loop itself, which cannot wait here: sent on
            future.add_done_callback(_log_failure)
            return
        try:
            future.result(PUSH_TIMEOUT_S + 5)
        except TimeoutError:
            future.cancel()
            raise

    return mirror


async def push_file(channel: AgentChannel, name: str, data: bytes) -> None:
    """Write the host-tool file `name` into the machine (root's, readable by its user)."""
    path = posixpath.join(HOST_TOOLS_DIR_IN_SANDBOX, name)
    await run_as_root(channel, ["/bin/true"], files={path: (data, FILE_MODE)})


async def run_as_root(
    channel: AgentChannel, argv: list[str], *, files: dict[str, tuple[bytes, int]] | None = None
) -> None:
    """Run `argv` in the machine as its root (after writing `files`), to its end; killed if
    its caller gives up on it."""
    pid, io, _ = await channel.spawn(
        argv,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        uid=0,
        gid=0,
        tag="host-work",
        separate_stderr=False,
        files=files,
    )
    io.close()
    try:
        await channel.wait_child(pid)
    except BaseException:
        with contextlib.suppress(SandboxError):
            await channel.signal(pid, signal.SIGKILL)
        raise


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a worker thread's
        return None


def _log_failure(future: object) -> None:
    exception = getattr(future, "exception", lambda: None)()
    if exception is not None:
        log.warning("a host-tool file was not copied into its machine: %s", exception)
