"""Output that is not UTF-8 is dropped as malformed, never looped on.

`print('\\udc80' * n)` reaches us as n raw continuation bytes (jupyter_client encodes with
surrogateescape). The decoder that cuts long texts once backed off a chunk's end over
continuation bytes until it reached the chunk's start, then decoded nothing and started over:
a worker thread spun forever, the execute never answered and the service could not shut down.
"""

from __future__ import annotations

import asyncio

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Sandbox

RUN_LIMIT_S = 30.0


async def test_output_that_is_not_utf8_is_dropped_within_the_time_limit(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    ex = await asyncio.wait_for(
        sandbox.execute("print('\\udc80' * 5_000_000)", timeout_s=RUN_LIMIT_S),
        RUN_LIMIT_S + 30,
    )
    assert ex.status is ExecutionStatus.OK, ex.error
    assert ex.notice is not None and "malformed messages from the kernel were dropped" in ex.notice
    assert "\udc80" not in ex.stdout
    # The session goes on, with its state.
    assert (await sandbox.execute("x = 41\nx + 1")).text == "42"
