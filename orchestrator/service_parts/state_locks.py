"""One change of a session's state (pause, resume, end of a paused one) at a time: a call that
finds one under way waits for it.

In cluster mode every replica may change any shared session's state, so the lock is also a
lease in the shared Redis (cluster/leases.py): a session is paused, resumed or ended by one
replica at a time, and a replica that waited finds what the other did (it reads the record
again).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from orchestrator.cluster.leases import WAIT_S, lease

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection


class StateLocks:
    def __init__(self, shared: RedisConnection | None = None) -> None:
        """`shared`: the Redis every replica shares (cluster mode), where leases are held."""
        # Weak: a session nobody is changing holds no lock.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._shared = shared

    def of(self, session_id: str, wait_s: float = WAIT_S) -> AbstractAsyncContextManager[None]:
        """Held while it changes; `wait_s`: the longest to wait for another replica's change
        (then LeaseBusy)."""
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return self._held(session_id, lock, wait_s)

    @contextlib.asynccontextmanager
    async def _held(
        self, session_id: str, lock: asyncio.Lock, wait_s: float
    ) -> AsyncIterator[None]:
        async with lock:  # this frame keeps the weak entry alive while it waits or holds
            if self._shared is None:
                yield
                return
            what = f"changing session {session_id}'s state"
            async with lease(self._shared, f"state:{session_id}", what, wait_s):
                yield

    def __contains__(self, session_id: str) -> bool:
        """Whether a change of its state is under way here (or a call waits for one)."""
        return session_id in self._locks
