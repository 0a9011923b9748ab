"""A slow stream client's backlog: bounded in characters, and it is told what it missed."""

from __future__ import annotations

import asyncio

import pytest

from code_interpreter_wire.results import ErrorEvent, ExecutionError, OutputEvent, StdoutEvent
from orchestrator.streaming import Backlog, Dropped, Finished, follow
from sandbox.kernel.collector import EventSink

pytestmark = pytest.mark.unit


async def test_past_the_limit_events_are_counted_not_kept() -> None:
    backlog = Backlog(limit_chars=10)
    for _ in range(5):
        await backlog.put(StdoutEvent(text="abcd"))
    assert backlog.chars == 8  # two kept; three dropped
    assert [backlog.next(), backlog.next()] == [StdoutEvent(text="abcd")] * 2
    assert backlog.next() == Dropped(events=3, characters=12)
    assert backlog.next() is None


async def test_a_first_event_is_kept_however_large() -> None:
    backlog = Backlog(limit_chars=10)
    await backlog.put(StdoutEvent(text="x" * 100))
    assert backlog.next() == StdoutEvent(text="x" * 100)


async def test_a_dropped_error_is_still_delivered_after_the_notice() -> None:
    backlog = Backlog(limit_chars=10)
    await backlog.put(StdoutEvent(text="x" * 10))
    error = ErrorEvent(error=ExecutionError(name="E", value="v"))
    await backlog.put(error)
    assert backlog.next() == StdoutEvent(text="x" * 10)
    assert backlog.next() == Dropped(events=1, characters=2)
    assert backlog.next() == error


async def test_the_run_never_waits_for_the_client() -> None:
    async def run(sink: EventSink) -> str:
        for _ in range(10_000):
            await sink(StdoutEvent(text="y" * 1000))
        return "finished"

    items: list[OutputEvent | Dropped | object] = []
    async for item in follow(run, backlog_limit_chars=100_000):
        if not items:
            await asyncio.sleep(0.2)  # a slow client: the run ends meanwhile
        items.append(item)
    assert isinstance(items[-1], Finished) and items[-1].value == "finished"
    dropped = [i for i in items if isinstance(i, Dropped)]
    assert sum(d.events for d in dropped) > 9000
    assert len(items) < 200
