"""Raw bytes from one stream to another (a CONNECT tunnel's two directions): bounded chunks,
backpressure through `drain`, the byte cap, and a half-close passed on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from sandbox.egress.metering import CapReached, Meter

CHUNK = 64 * 1024


async def send(writer: asyncio.StreamWriter, data: bytes, meter: Meter, *, up: bool) -> None:
    """Write what the cap allows of `data` and wait until the peer takes it; `CapReached` when
    the cap cut it."""
    allowed = meter.take(data, up=up)
    if allowed:
        writer.write(allowed)
        await writer.drain()
        meter.touch()
    if len(allowed) < len(data):
        raise CapReached()


async def pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    meter: Meter,
    *,
    up: bool,
    observe: Callable[[bytes], None] | None = None,
) -> None:
    """Copy until end of file, then half-close the writer so the far side sees the end too
    (where it can: a TLS stream cannot, see `tunnel`). `observe` is shown each chunk before it
    is sent."""
    while True:
        chunk = await reader.read(CHUNK)
        if not chunk:
            break
        if observe is not None:
            observe(chunk)
        await send(writer, chunk, meter, up=up)
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()


async def tunnel(up: Awaitable[None], down: Awaitable[None], *, ends_with_up: bool = False) -> None:
    """Both directions of a tunnel. The client's end of sending is passed on (a half-close) and
    the answer still flows back; the destination's end of sending ends the tunnel once all it
    sent is delivered, as a destination closing means the exchange is over. A failure of either
    direction ends both. `ends_with_up`: the client's end of sending ends it too (where a
    half-close cannot be passed on: TLS ended by the proxy)."""
    up_task, down_task = asyncio.ensure_future(up), asyncio.ensure_future(down)
    waiting = {up_task, down_task}
    try:
        while not down_task.done() and not (ends_with_up and up_task.done()):
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    finally:
        for task in (up_task, down_task):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
