"""Following a run as it happens: its events, a keepalive when it is quiet, then its end.

Every streaming route (ours and E2B's) does the same: start the run with an event sink, hand on
each event as it comes, say something at least every few seconds so proxies keep the connection,
and stop the run if the client leaves. Each route only chooses how a line looks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sandbox.kernel.collector import EventSink
from sandbox.models import OutputEvent

KEEPALIVE_S = 5.0
T = TypeVar("T")


class Keepalive:
    """Nothing happened for a while."""


KEEPALIVE = Keepalive()


@dataclass
class Finished(Generic[T]):
    """The run's own result, after its last event."""

    value: T


async def follow(
    start: Callable[[EventSink], Awaitable[T]], *, keepalive_s: float = KEEPALIVE_S
) -> AsyncGenerator[OutputEvent | Keepalive | Finished[T]]:
    """Events of the run `start(sink)` begins, keepalives, then `Finished`; the run's exception
    is raised after its events. Leaving early (the client went away) cancels the run, which
    interrupts its code."""
    queue: asyncio.Queue[OutputEvent] = asyncio.Queue()
    task = asyncio.ensure_future(start(queue.put))
    getter: asyncio.Future[OutputEvent] | None = None
    try:
        while not (task.done() and queue.empty()):
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait(
                {getter, task}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            if not done:
                yield KEEPALIVE
        yield Finished(task.result())
    finally:
        if getter is not None:
            getter.cancel()
        if not task.done():
            task.cancel()
