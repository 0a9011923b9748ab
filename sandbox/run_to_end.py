"""Work that must not be cut short: removing what a sandbox made, while the sandbox is closed.

Cancelling a task that waits on a thread leaves the thread running and whatever it makes (a
container, a kernel) unowned; a close that cancels such work must still find it finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_even_if_cancelled(work: Awaitable[T]) -> T:
    """Await `work` to its end. A cancellation that comes meanwhile is raised once it is over
    (so the caller's clean-up runs after it, never beside it), chained to the work's own
    error if it failed. Only a loop shutting down (which cancels every task) cuts it short:
    what it then leaves, the next start's clean-up of orphans finds."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        failure = None if task.cancelled() else task.exception()  # retrieved, so never lost
        raise asyncio.CancelledError from failure
    return task.result()
