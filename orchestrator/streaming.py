"""Following a run as it happens: its events, a keepalive when it is quiet, then its end.

Every streaming route (ours and E2B's) does the same: start the run with an event sink, hand on
each event as it comes, say something at least every few seconds so proxies keep the connection,
and stop the run if the client leaves. Each route only chooses how a line looks.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from code_interpreter_wire.results import (
    ErrorEvent,
    EventSink,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)
from sandbox.kernel.collector import bundle_size

KEEPALIVE_S = 5.0
# What one client that reads slowly may leave queued, in characters of output: past it, events
# are dropped (and counted) until the client catches up. The run never waits for a client.
BACKLOG_LIMIT_CHARS = 8 << 20
T = TypeVar("T")


class Keepalive:
    """Nothing happened for a while."""


KEEPALIVE = Keepalive()


@dataclass
class Finished(Generic[T]):
    """The run's own result, after its last event."""

    value: T


@dataclass(frozen=True)
class Dropped:
    """Events left out while the client read more slowly than the run produced them."""

    events: int
    characters: int

    @property
    def message(self) -> str:
        return (
            f"[{self.events} output events ({self.characters} characters) were not streamed: "
            "the client read more slowly than the code wrote; the final result keeps "
            "everything the output limits allow]\n"
        )


def event_size(event: OutputEvent) -> int:
    """Characters an event holds, near enough to bound a backlog by."""
    if isinstance(event, StdoutEvent | StderrEvent):
        return len(event.text)
    if isinstance(event, ErrorEvent):
        return len(event.error.name) + len(event.error.value) + len(event.error.traceback)
    if isinstance(event, ResultEvent):
        return result_size(event.result)
    return 0


def result_size(result: Result) -> int:
    r = result
    forms = (r.text, r.html, r.markdown, r.latex, r.png, r.jpeg, r.svg, r.pdf, r.javascript)
    size = sum(len(form) for form in forms if form)
    for form in (result.json_data, result.chart, result.data):
        if form is not None:
            size += len(json.dumps(form, default=str))
    return size + bundle_size(result.extra)


class Backlog:
    """The events a client has yet to read, bounded in characters; what is dropped is counted.

    The first event waiting is always kept, however large (results are already capped by the
    run, and the event shares its memory with the run's own record)."""

    def __init__(self, limit_chars: int = BACKLOG_LIMIT_CHARS) -> None:
        self.limit_chars = limit_chars
        self.events: deque[tuple[OutputEvent, int]] = deque()
        self.chars = 0
        self.dropped_events = 0
        self.dropped_chars = 0
        self.dropped_error: ErrorEvent | None = None  # the last error dropped, sent when caught up
        self.ready = asyncio.Event()

    async def put(self, event: OutputEvent) -> None:
        size = event_size(event)
        if self.events and self.chars + size > self.limit_chars:
            self.dropped_events += 1
            self.dropped_chars += size
            if isinstance(event, ErrorEvent):
                self.dropped_error = event
            return
        if isinstance(event, ErrorEvent):
            self.dropped_error = None  # a later error supersedes it
        self.events.append((event, size))
        self.chars += size
        self.ready.set()

    def next(self) -> OutputEvent | Dropped | None:
        """The next item for the client: an event, then, once caught up, what was dropped."""
        if self.events:
            event, size = self.events.popleft()
            self.chars -= size
            return event
        self.ready.clear()
        if self.dropped_events:
            dropped = Dropped(self.dropped_events, self.dropped_chars)
            self.dropped_events = self.dropped_chars = 0
            return dropped
        if self.dropped_error is not None:
            error, self.dropped_error = self.dropped_error, None
            return error
        return None


async def follow(
    start: Callable[[EventSink], Awaitable[T]],
    *,
    keepalive_s: float = KEEPALIVE_S,
    backlog_limit_chars: int = BACKLOG_LIMIT_CHARS,
) -> AsyncGenerator[OutputEvent | Dropped | Keepalive | Finished[T]]:
    """Events of the run `start(sink)` begins, keepalives, then `Finished`; the run's exception
    is raised after its events. A client that falls behind by more than `backlog_limit_chars`
    misses events, and is told how many (`Dropped`) when it catches up. Leaving early (the
    client went away) cancels the run, which interrupts its code."""
    backlog = Backlog(backlog_limit_chars)
    task = asyncio.ensure_future(start(backlog.put))
    waiter: asyncio.Future[Any] | None = None
    try:
        while True:
            item = backlog.next()
            if item is not None:
                yield item
                continue
            if task.done():
                break
            waiter = ready = asyncio.ensure_future(backlog.ready.wait())
            done, _ = await asyncio.wait(
                {ready, task}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            ready.cancel()
            if not done:
                yield KEEPALIVE
        yield Finished(task.result())
    finally:
        if waiter is not None:
            waiter.cancel()
        if not task.done():
            task.cancel()
