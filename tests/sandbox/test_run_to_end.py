"""`finish_even_if_cancelled`: work a close must find finished, though its caller was cancelled."""

from __future__ import annotations

import asyncio

import pytest

from sandbox.run_to_end import finish_even_if_cancelled


async def test_a_cancelled_caller_waits_for_the_work_then_is_cancelled() -> None:
    gate = asyncio.Event()
    steps: list[str] = []

    async def work() -> str:
        await gate.wait()
        steps.append("work done")
        return "made"

    async def caller() -> None:
        try:
            await finish_even_if_cancelled(work())
        finally:
            steps.append("caller's clean-up")

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)  # the caller is waiting on the work
    task.cancel()
    task.cancel()  # twice: still not cut short
    await asyncio.sleep(0)
    assert not task.done() and steps == []
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["work done", "caller's clean-up"]


async def test_the_works_result_or_error_comes_back_uncancelled() -> None:
    async def made() -> int:
        return 7

    async def failed() -> None:
        raise ValueError("no")

    assert await finish_even_if_cancelled(made()) == 7
    with pytest.raises(ValueError, match="no"):
        await finish_even_if_cancelled(failed())
