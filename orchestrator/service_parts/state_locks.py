"""One change of a session's state (pause, resume, end of a paused one) at a time: a call that
finds one under way waits for it."""

from __future__ import annotations

import asyncio
import weakref


class StateLocks:
    def __init__(self) -> None:
        # Weak: a session nobody is changing holds no lock.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def of(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    def __contains__(self, session_id: str) -> bool:
        """Whether a change of its state is under way (or a call waits for one)."""
        return session_id in self._locks
