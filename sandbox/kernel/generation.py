"""One kernel generation: the kernel process a launcher started, and our connection to it.

Starting one (its directory reset, a fresh connection file, the launch), asking whether it
answers, sending it code or an interrupt, and disposing of it. What to do with a generation
(run code, replace it when it dies) is the driver's (driver.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from jupyter_client.asynchronous.client import AsyncKernelClient

from code_interpreter_wire.errors import SandboxClosed, SandboxStartError
from sandbox.host_channel import TOOL_ORIGIN_METADATA
from sandbox.kernel.channels import KernelChannels
from sandbox.kernel.connection import reset_kernel_dir, write_connection_file
from sandbox.kernel.process import KernelExit, KernelLauncher, KernelProcess
from sandbox.kernel.programs import INTERRUPT_SOCKET
from sandbox.languages import KERNEL_TRAITS
from sandbox.run_to_end import finish_even_if_cancelled

if TYPE_CHECKING:
    from jupyter_client.connect import KernelConnectionInfo

log = logging.getLogger(__name__)


@dataclass
class KernelGeneration:
    """One kernel: its process, client (to send), readers and the future of its death."""

    generation: int
    process: KernelProcess
    client: AsyncKernelClient
    channels: KernelChannels
    exited: asyncio.Future[KernelExit]


async def launch_generation(
    launcher: KernelLauncher, generation: int, *, frame_limit: int, text_limit: int
) -> KernelGeneration:
    """Start generation `generation` of the launcher's kernel and connect to it (it may not
    answer yet: `answers`). If connecting fails, the kernel is killed: it must not outlive it."""
    reset_kernel_dir(launcher.kernel_dir, launcher.kernel_uid)
    kept_key = getattr(launcher, "kept_key", None)  # a launcher that takes over a kernel
    in_sandbox, info = write_connection_file(
        launcher.kernel_dir,
        launcher.kernel_dir_in_sandbox,
        generation,
        launcher.kernel_uid,
        key=kept_key() if callable(kept_key) else None,
    )
    process = await launcher.launch(in_sandbox)
    exited: asyncio.Future[KernelExit] = asyncio.ensure_future(process.wait())
    try:
        client = AsyncKernelClient()
        client.load_connection_info(cast("KernelConnectionInfo", info))
        moved = getattr(process, "output_moved", None)  # a process whose iopub is relayed
        channels = KernelChannels(
            client,
            frame_limit=frame_limit,
            text_limit=text_limit,
            output_moved=moved if callable(moved) else None,
        )
    except BaseException:
        exited.cancel()
        await finish_even_if_cancelled(process.kill())
        raise
    return KernelGeneration(generation, process, client, channels, exited)


_MOST_ASKED_AT_ONCE = 16  # kernel_info requests left waiting for their replies


async def answers(
    kernel: KernelGeneration, startup_timeout_s: float, closed: Callable[[], bool]
) -> bool:
    """Ask for kernel_info until the shell answers and iopub is seen to be connected: True;
    False once the kernel is found dead instead. `closed()`: its sandbox was closed meanwhile
    (SandboxClosed; the caller disposes of the kernel).

    A reply to any request still counts, and the wait between requests grows: a kernel slow
    to answer each (a JVM starting on a loaded host) is never asked faster than it answers,
    which would leave every reply one the wait had already given up on."""
    deadline = time.monotonic() + startup_timeout_s
    asked: dict[str, asyncio.Future[dict[str, Any]]] = {}
    pause = 0.5
    try:
        while True:
            if closed():
                raise SandboxClosed("the sandbox was closed while its kernel started")
            if kernel.exited.done():
                return False
            if time.monotonic() > deadline:
                channels = kernel.channels
                raise SandboxStartError(
                    f"the kernel did not answer within {startup_timeout_s:.0f} s of starting "
                    f"({channels.shell_received} shell messages read; output channel "
                    f"{'live' if channels.iopub_seen.is_set() else 'silent'})"
                )
            msg_id = kernel.client.kernel_info()
            kernel.channels.sent_on_shell()
            asked[msg_id] = kernel.channels.reply_to(msg_id)
            if len(asked) > _MOST_ASKED_AT_ONCE:
                oldest = next(iter(asked))
                kernel.channels.forget_reply(oldest)
                del asked[oldest]
            # A death ends the wait at once, not after it.
            either: set[asyncio.Future[Any]] = {*asked.values(), kernel.exited}
            await asyncio.wait(either, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            if not any(_answered(reply) for reply in asked.values()):
                pause = min(pause * 1.5, 3.0)
                continue
            # Each request is answered with busy/idle on iopub: seeing any message proves
            # that our subscription is live, so no output of the first execution is lost.
            try:
                await asyncio.wait_for(kernel.channels.iopub_seen.wait(), 0.2)
            except TimeoutError:
                for done in [key for key, reply in asked.items() if _answered(reply)]:
                    del asked[done]
                continue  # ask again: its busy/idle may reach a subscription live by now
            return True
    finally:
        for msg_id in asked:
            kernel.channels.forget_reply(msg_id)


def _answered(reply: asyncio.Future[dict[str, Any]]) -> bool:
    return reply.done() and not reply.cancelled()


async def dispose(kernel: KernelGeneration) -> None:
    """Kill the kernel and drop our connection to it. A caller cancelled meanwhile still
    waits until the kill is done, then is cancelled: nothing of the kernel outlives it."""
    try:
        await finish_even_if_cancelled(kernel.process.kill())
    finally:
        kernel.channels.close()
        kernel.exited.cancel()


def send_execute(kernel: KernelGeneration, code: str, silent: bool, origin: str | None) -> str:
    """`client.execute` (as jupyter_client builds it), with the tool origin in the metadata,
    where the kernel's start-up file reads it; the request's msg_id."""
    client = kernel.client
    content = {
        "code": code,
        "silent": silent,
        "store_history": not silent,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }
    metadata = {TOOL_ORIGIN_METADATA: origin} if origin is not None else {}
    msg = client.session.msg("execute_request", content, metadata=metadata)
    client.shell_channel.send(msg)
    kernel.channels.sent_on_shell()
    return cast(str, msg["header"]["msg_id"])


def send_interrupt(kernel: KernelGeneration, language: str, launcher: KernelLauncher) -> None:
    """Interrupt the code the kernel runs. Message mode works the same in every backend: no
    signal has to cross a namespace. A kernel that ignores it is sent SIGINT by its
    supervisor, asked over a socket."""
    if KERNEL_TRAITS[language].interrupt_by_signal:
        poke_interrupt_socket(launcher.kernel_dir / INTERRUPT_SOCKET)
        return
    client = kernel.client
    client.control_channel.send(client.session.msg("interrupt_request", {}))


def poke_interrupt_socket(path: os.PathLike[str] | str) -> None:
    """Write one byte to the supervisor's interrupt socket, without following a link the
    sandbox may have put in its place: the socket is opened by O_PATH and reached through
    /proc/self/fd, and must be a socket."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("cannot interrupt the kernel: %s", exc)
        return
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            log.warning("the kernel's interrupt socket is not a socket; not interrupting")
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.setblocking(False)  # a full backlog: skip it; the grace period restarts the kernel
            with contextlib.suppress(OSError):
                s.connect(f"/proc/self/fd/{fd}")
                s.send(b"\x03")
    finally:
        os.close(fd)
