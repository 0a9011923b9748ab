"""One background thread running an event loop for the process, and the two ways to use it.

Sandboxes, HTTP clients and sessions are bound to the loop that made them; running every call
of a shared object on this loop lets sync callers and async callers on any loop (a framework's,
a thread's) use it alike. Light on purpose: the client package uses it without the server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="sandbox-loop", daemon=True).start()
    return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the shared background loop and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result()


async def run_in_background(coro: Coroutine[Any, Any, T]) -> T:
    """Await a coroutine that runs on the shared background loop."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _background_loop()))
