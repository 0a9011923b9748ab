"""A gVisor machine's ports (sandbox/port_relay.py): its network stack is the Sentry's own, with
no host namespace to enter, so a connection is a relay process the machine's agent starts; it
carries bytes both ways and says when nothing listens."""

from __future__ import annotations

import asyncio
import os

import pytest

from code_interpreter_wire.errors import PortUnreachable
from sandbox.backends.gvisor.backend import GvisorBackend
from sandbox.port_relay import open_port
from tests.conftest import small_spec
from tests.sandbox.test_port_relay import ECHO_SERVER, read_all


async def test_a_port_in_a_machine_is_relayed_both_ways(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    try:
        assert (await sb.execute(ECHO_SERVER.format(port=8765))).ok
        payload = os.urandom(200_000)
        stream = await open_port(sb.spawner(), 8765)
        try:
            await stream.write(payload)
            await stream.write_eof()
            assert await asyncio.wait_for(read_all(stream), 60) == payload
        finally:
            await stream.close()
        with pytest.raises(PortUnreachable, match="nothing answers on port 8799"):
            await open_port(sb.spawner(), 8799)
        again = await open_port(sb.spawner(), 8765)  # the server lives on, served again
        try:
            await again.write(b"again")
            await again.write_eof()
            assert await asyncio.wait_for(read_all(again), 60) == b"again"
        finally:
            await again.close()
    finally:
        await sb.close()
