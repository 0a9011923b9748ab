"""A byte stream to a TCP port inside a sandbox, for servers its code starts (inbound ports).

Nothing of the host dials into the sandbox's network, which keeps no interface but `lo` (and
under gVisor has no host network namespace at all): each connection is a process of the
sandbox, the relay (inside_kernel/port_relay.py), started through the backend's own process
spawner, which dials the sandbox's loopback and carries the bytes over its stdin and stdout.
Every backend that runs processes beside its kernel can do this, with nothing bound into its
sandboxes, so pooled and resumed sandboxes serve ports as fresh ones do.

This module is the host's end: open, read, write, half-close, close. Who may open one, how
many and how much are the service's decisions (orchestrator/service_parts/ports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from code_interpreter_wire.errors import PortUnreachable, SandboxError
from code_interpreter_wire.processes import ProcessRequest, Stream
from sandbox.inside_kernel import port_relay
from sandbox.processes.spawned import SpawnedProcess, Spawner

log = logging.getLogger(__name__)

RELAY_SOURCE = Path(port_relay.__file__).read_text()
CLOSE_WAIT_S = 10.0
_READY = port_relay.READY
_MOST_STDERR = 4096  # bytes of the relay's own words kept, for the reason it failed


class PortStream:
    """One connection to a port in a sandbox. `read` returns b"" once the server's side is
    closed; `close` ends the relay (and with it the connection) whatever its state."""

    def __init__(self, process: SpawnedProcess, output: AsyncIterator[tuple[Stream, bytes]]):
        self._process = process
        self._output = output
        self._pending = b""
        self._ended = False
        self._closed = False

    async def read(self, max_bytes: int) -> bytes:
        if not self._pending and not self._ended:
            async for stream, chunk in self._output:
                if stream == "stdout" and chunk:
                    self._pending = chunk
                    break
            else:
                self._ended = True
        data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return data

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("the connection to the sandbox's port is closed")
        try:
            await self._process.write_stdin(data)
        except (SandboxError, OSError) as exc:
            raise ConnectionResetError(f"the sandbox's port took no more data: {exc}") from exc

    async def write_eof(self) -> None:
        with contextlib.suppress(SandboxError, OSError):
            await self._process.close_stdin()

    async def close(self) -> None:
        """End the relay and wait for it (at most CLOSE_WAIT_S: a sandbox that stopped its
        own command server holds nothing of the host's longer)."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(asyncio.shield(self._end()), CLOSE_WAIT_S)
        except TimeoutError:
            log.warning("a port relay did not end within %s s; left to its sandbox", CLOSE_WAIT_S)

    async def _end(self) -> None:
        with contextlib.suppress(SandboxError, OSError):
            await self._process.close_stdin()
        with contextlib.suppress(SandboxError, OSError, ProcessLookupError):
            await self._process.signal(signal.SIGKILL)
        finish = getattr(self._output, "aclose", None)  # the reader tasks of its pipes
        if finish is not None:
            with contextlib.suppress(SandboxError, OSError, RuntimeError):
                await finish()
        with contextlib.suppress(SandboxError, OSError):
            await self._process.wait()


async def open_port(
    spawner: Spawner, port: int, *, python: str = "python3", timeout_s: float = 20.0
) -> PortStream:
    """A connection to `port` on the sandbox's loopback; PortUnreachable (with the reason)
    when nothing answers there or the relay cannot start; `timeout_s` covers both."""
    if not 1 <= port <= 65535:
        raise PortUnreachable(f"port {port} is not a TCP port (1 to 65535)")
    # -I -S: nothing of the workspace, PYTHONPATH or site-packages shadows what it imports.
    request = ProcessRequest(
        argv=[python, "-I", "-S", "-c", RELAY_SOURCE, str(port)], stdin=True, cwd="/"
    )
    try:
        process = await asyncio.wait_for(spawner.spawn(request), timeout_s)
    except TimeoutError:
        raise PortUnreachable(
            f"the sandbox's relay did not start within {timeout_s:.0f} s"
        ) from None
    output = process.output()
    stream = PortStream(process, output)
    try:
        said = await asyncio.wait_for(_first_words(output), timeout_s)
    except TimeoutError:
        await stream.close()
        raise PortUnreachable(
            f"port {port} did not answer the relay within {timeout_s:.0f} s"
        ) from None
    except BaseException:
        await stream.close()
        raise
    if said.startswith(_READY):
        stream._pending = said[len(_READY) :]
        return stream
    await stream.close()
    end = await process.wait()
    reason = said.decode("utf-8", "replace").strip() or (
        f"the sandbox's relay ended ({end.error or end.exit_code}) before connecting"
    )
    raise PortUnreachable(reason)


async def _first_words(output: AsyncIterator[tuple[Stream, bytes]]) -> bytes:
    """The relay's first stdout (READY and maybe the server's first bytes) or, if it fails,
    what it said on stderr until it ended."""
    said = b""
    async for stream, chunk in output:
        if stream == "stdout" and chunk:
            return chunk
        if stream == "stderr" and len(said) < _MOST_STDERR:
            said += chunk[: _MOST_STDERR - len(said)]
    return said
