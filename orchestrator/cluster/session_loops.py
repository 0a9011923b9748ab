"""One background loop per session and sandbox, for the relays that serve sessions whose sandbox
is on another machine (tool_relay.py, egress_relay.py): a session's loop is replaced when its
sandbox is another (resumed elsewhere, a stale copy replaced), forgotten when it ends by itself,
and cancelled when the session ends here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

# A relay's poll that failed (its cluster out of reach for now) is tried again after a pause,
# doubled after each failure in a row, up to RETRY_MAX_S; reset by a poll that answers.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


class Identified(Protocol):
    """A sandbox, as these loops tell one from another: by its id, which a new sandbox of the
    session (resumed elsewhere) does not share, and two handles on one sandbox (two attaches
    of it) do."""

    @property
    def id(self) -> str: ...


class SessionLoops:
    """The loops this replica runs, by session id, each with the id of the sandbox it serves."""

    def __init__(self) -> None:
        self._loops: dict[str, tuple[asyncio.Task[None], str]] = {}

    async def run(
        self,
        session_id: str,
        sandbox: Identified,
        loop: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        """Run `loop()` for the session; nothing changes while one runs on the same sandbox;
        one on another sandbox is stopped first."""
        running = self._loops.get(session_id)
        if running is not None and not running[0].done() and running[1] == sandbox.id:
            return
        # The new loop is in place before the old one is awaited: two runs at once leave one
        # loop, never one nobody can stop.
        task = asyncio.ensure_future(loop())
        self._loops[session_id] = (task, sandbox.id)
        task.add_done_callback(lambda done: self._forget(session_id, done))
        if running is not None:
            running[0].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running[0]

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        """A loop that ended by itself (its sandbox lost) is forgotten: a later run starts one."""
        running = self._loops.get(session_id)
        if running is not None and running[0] is task:
            del self._loops[session_id]

    async def stop(self, session_id: str) -> None:
        running = self._loops.pop(session_id, None)
        if running is not None:
            running[0].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running[0]

    async def close(self) -> None:
        for session_id in list(self._loops):
            await self.stop(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._loops

    def serves(self, session_id: str, sandbox: Identified) -> bool:
        """Whether a loop runs for the session on this very sandbox (not an earlier one)."""
        running = self._loops.get(session_id)
        return running is not None and not running[0].done() and running[1] == sandbox.id

    def serves_another(self, session_id: str, sandbox: Identified) -> bool:
        """Whether a loop runs for the session on a sandbox other than `sandbox` (a newer one:
        the session resumed elsewhere and attached here since)."""
        running = self._loops.get(session_id)
        return running is not None and not running[0].done() and running[1] != sandbox.id
