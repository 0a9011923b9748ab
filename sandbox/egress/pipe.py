"""Raw bytes from one stream to another (a CONNECT tunnel's two directions): bounded chunks,
backpressure through `drain`, the byte cap, and a half-close passed on."""

from __future__ import annotations

import asyncio

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
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, meter: Meter, *, up: bool
) -> None:
    """Copy until end of file, then half-close the writer so the far side sees the end too."""
    while True:
        chunk = await reader.read(CHUNK)
        if not chunk:
            break
        await send(writer, chunk, meter, up=up)
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
