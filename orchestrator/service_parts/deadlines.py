"""Deadlines a front gives its sessions (E2B's sandbox timeout): the rules of what happens when
one is reached, the same for every front, on the service's one sweeper.

A front keeps only when a session's deadline falls and what it asked for at that time (its own
wire state: E2B keeps it in the session's labels, so every replica and a restart see it); each
round it hands each session here. Before its deadline a session is kept alive, with the
sessions linked to it (E2B's contexts), whatever its idleness: a deadline, not idleness, ends
it. At its deadline it is ended, or paused when that is its action; a busy one is paused on a
later round, after its call ends; one that cannot be paused is ended, as its deadline says.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Literal

from orchestrator.service_parts.lifecycle import Lifecycle
from orchestrator.service_parts.sweeps import DeadlineRound, Sweeps
from orchestrator.sessions import Session, SessionError

log = logging.getLogger(__name__)

DeadlineAction = Literal["end", "pause"]
# What a round did with a session: nothing to do (no deadline), kept alive, paused, ended, or
# left for a later round (busy, to be paused once its call ends).
DeadlineOutcome = Literal["none", "kept", "paused", "ended", "later"]


class Deadlines:
    def __init__(self, lifecycle: Lifecycle, sweeps: Sweeps) -> None:
        self._lifecycle = lifecycle
        self._sweeps = sweeps

    @contextlib.asynccontextmanager
    async def rounds(self, round_: DeadlineRound) -> AsyncIterator[None]:
        """Run a front's round on the service's one sweeper while this is held."""
        async with self._sweeps.deadlines(round_):
            yield

    async def enforce(
        self,
        session: Session,
        deadline: float | None,
        *,
        action: DeadlineAction,
        linked: Sequence[str] = (),
        pause: Callable[[], Awaitable[None]],
        end: Callable[[], Awaitable[None]],
        name: str,
    ) -> DeadlineOutcome:
        """Apply the rules to a running `session` whose deadline (`time.time()`) is `deadline`
        (None: it has none, its idle expiry governs it). `linked`: ids of its owner's sessions
        kept alive with it. `pause` and `end` are the front's own (they also drop what it keeps
        of the session); `name` is how the log names it."""
        if deadline is None:
            return "none"
        if time.time() < deadline:
            await self._keep_alive(session, linked)
            return "kept"
        if action == "pause":
            if session.busy:  # its code runs on: paused on a round after its call ends
                return "later"
            try:
                await pause()
            except Exception as exc:
                log.warning("%s could not be paused at its deadline: %s", name, exc)
            else:
                log.info("%s reached its deadline and was paused", name)
                return "paused"
        log.info("%s reached its deadline", name)
        await end()
        return "ended"

    async def _keep_alive(self, session: Session, linked: Sequence[str]) -> None:
        """Kept alive for every replica's reaper; one lost says so on its next call."""
        with contextlib.suppress(SessionError):
            await self._lifecycle.keepalive(session)
        for session_id in linked:
            other = await self._lifecycle.state(session_id, session.owner)
            if isinstance(other, Session):
                with contextlib.suppress(SessionError):
                    await self._lifecycle.keepalive(other)
