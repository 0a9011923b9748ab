"""The host's side of a served process, on what the kernel gives it."""

from __future__ import annotations

import asyncio
import os

from sandbox.processes.served import terminal_reader


async def test_a_terminal_that_closed_before_it_was_read_still_gives_its_output() -> None:
    """The command wrote and ended (its side closed) before the host read a byte: the master
    holds the output and then reads EIO, which ends it rather than replacing it."""
    master, slave = os.openpty()
    os.write(slave, b"30 90\nvt100\n")
    os.close(slave)
    reader = await terminal_reader(master)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    # The event loop takes the output and then the EIO before anything asks for a byte.
    while not _both_taken(reader):
        assert loop.time() < deadline, "the master was never read to its end"
        await asyncio.sleep(0.01)
    assert (await reader.read()).split() == [b"30", b"90", b"vt100"]
    assert await reader.read() == b""


def _both_taken(reader: asyncio.StreamReader) -> bool:
    """The reader holds output and knows the end: nothing is left for the master to say."""
    transport = getattr(reader, "_transport", None)
    return transport is not None and transport.is_closing()
