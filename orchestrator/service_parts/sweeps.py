"""Sweeps: what the reaper does with sessions past their time (auto-pause, or end), what the
service pauses as it shuts down, and what each reaper round deletes (revoked keys' sessions,
paused sessions past their retention, old audit events), and the deadline rounds fronts with
deadlines of their own (E2B's sandbox timeouts) run on the one sweeper."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from orchestrator.cluster.leases import LeaseBusy
from orchestrator.cluster.shared import SharedSandbox
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.pausing import Pauses
from orchestrator.service_parts.persistence import Persistence
from orchestrator.service_parts.state_locks import StateLocks
from orchestrator.sessions import Session, SessionBusy, SessionError, SessionManager
from orchestrator.settings_sections import ExpirySection
from orchestrator.state_store import SessionRecord

log = logging.getLogger(__name__)

# The most a deadline (E2B's sandbox timeout) is overrun by: its round runs at least this often.
DEADLINE_ROUND_MAX_S = 5.0
DeadlineRound = Callable[[], Awaitable[object]]
_IDLE_LEASE_WAIT_S = 1.0  # a reaper never waits long for a session another replica changes


class Sweeps:
    def __init__(
        self,
        settings: ExpirySection,
        sessions: SessionManager,
        admission: Admission,
        persistence: Persistence,
        trail: AuditTrail,
        pauses: Pauses,
        locks: StateLocks,
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        self._admission = admission
        self._records = persistence
        self._trail = trail
        self._pauses = pauses
        self._locks = locks
        self._revoked_ended: set[str] = set()  # revoked principals with nothing left to end
        self._deadline_rounds: list[DeadlineRound] = []
        self._deadline_sweeper: asyncio.Task[None] | None = None

    async def expired(self, session: Session, why: str) -> None:
        """The reaper's verdict: paused (auto-pause), or ended when that is off or fails."""
        if session.on_idle != "pause" or self.settings.idle_action != "pause":
            await self._sessions.end(session.id, why)
            return
        async with self._locks.of(session.id):
            if self._sessions.live(session.id) is not session or session.busy:
                return
            if self._sessions.overdue(session) is None:  # used while the lock was awaited
                return
            try:
                await self._pauses.pause(session)
            except Exception as exc:
                log.warning("session %s could not be paused (%s): ending it", session.id, exc)
                await self._sessions.end(session.id, f"{why}; it could not be paused ({exc})")

    async def idle_shared(self, record: SessionRecord, why: str) -> bool:
        """A shared session any replica's reaper found due (cluster mode): paused, where
        auto-pause is on and it can be, under its lease (one replica pauses it; the others find
        it paused). True when that is done with (paused, or used again meanwhile); False:
        the reaper ends it."""
        if record.on_idle != "pause" or self.settings.idle_action != "pause":
            return False
        if not self._sessions.pauses(record.backend):  # its saved state would be this one's
            return False
        if record.id in self._locks:  # a change of it is under way here
            return True
        try:
            async with self._locks.of(record.id, wait_s=_IDLE_LEASE_WAIT_S):
                return await self._pause_idle(record)
        except LeaseBusy:  # another replica is changing it: its reaper's turn next round
            return True

    async def _pause_idle(self, record: SessionRecord) -> bool:
        try:
            session = await self._sessions.get(record.id, record.owner)
        except SessionError:  # paused or ended by another replica meanwhile
            return True
        shared = session.sandbox
        if session.busy or not isinstance(shared, SharedSandbox):
            return True
        try:
            idle_s, in_flight = await shared.activity()
            timeout = session.idle_timeout_s or self.settings.idle_timeout_s
            if in_flight or idle_s <= timeout:  # used while the lease was awaited
                return True
            await self._pauses.pause(session)
        except SessionBusy:  # used (through another replica) while it was saved: not idle
            return True
        except Exception as exc:
            log.warning("session %s could not be paused (%s): ending it", record.id, exc)
            return False
        return True

    async def pause_all(self) -> None:
        """On shutdown: pause what auto-pause would, all at once, so a restart finds it whole;
        what cannot be paused in time ends with the rest."""
        s = self.settings
        if not self._records.started or not s.pause_on_shutdown or s.idle_action != "pause":
            return
        # Not those every replica serves: they live on in the cluster, served by the others.
        due = [
            x
            for x in self._sessions.all()
            if x.on_idle == "pause" and not self._sessions.shared(x.backend)
        ]

        async def pause(session: Session) -> None:
            async with self._locks.of(session.id):
                if self._sessions.live(session.id) is not session:
                    return
                try:
                    await asyncio.wait_for(self._pauses.pause(session), s.shutdown_pause_timeout_s)
                except Exception as exc:  # it ends with the others
                    log.warning("session %s could not be paused at shutdown: %s", session.id, exc)

        await asyncio.gather(*(pause(x) for x in due))

    @contextlib.asynccontextmanager
    async def deadlines(self, round_: DeadlineRound) -> AsyncIterator[None]:
        """Run `round_` (a front's deadlines: E2B's sandbox timeouts, kill or auto-pause) on
        the service's deadline sweeper while this is held: every reaper interval, at most
        DEADLINE_ROUND_MAX_S apart. One sweeper task serves every front's rounds."""
        self._deadline_rounds.append(round_)
        if self._deadline_sweeper is None:
            self._deadline_sweeper = asyncio.ensure_future(self._sweep_deadlines_forever())
        try:
            yield
        finally:
            self._deadline_rounds.remove(round_)
            if not self._deadline_rounds and self._deadline_sweeper is not None:
                sweeper, self._deadline_sweeper = self._deadline_sweeper, None
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper

    async def _sweep_deadlines_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.settings.reap_interval_s, DEADLINE_ROUND_MAX_S))
            for round_ in list(self._deadline_rounds):
                try:
                    await round_()
                except Exception:
                    log.exception("a deadline round failed")

    async def sweep(self) -> None:
        """Each reaper round: what is kept past its time goes."""
        await self._trail.log.sweep()  # first: it never raises
        try:
            await self._sweep_revoked()
        except Exception:
            log.exception("ending the sessions of revoked keys failed")
        await self._sweep_paused()

    async def _sweep_revoked(self) -> None:
        """End the sessions of revoked keys, running and paused: those this replica runs, the
        shared ones and the paused ones the store has (every replica sweeps: each ends its own;
        a principal with nothing left to end is not asked about again)."""
        revoked = self._admission.principals.revoked()
        why = "ended: its key was revoked"
        for session in [x for x in self._sessions.all() if x.owner in revoked]:
            log.info("session %s %s", session.id, why)
            await self._sessions.end(session.id, why)
        for owner in revoked.keys() - self._revoked_ended:
            records = await self._records.of_owner(owner)
            for record in records:
                if record.state == "paused":
                    async with self._locks.of(record.id):
                        if self._sessions.live(record.id) is None:
                            await self._pauses.delete(record, why)
                elif self._sessions.shared(record.backend):
                    await self._sessions.end(record.id, why)
            if not records:
                self._revoked_ended.add(owner)

    async def _sweep_paused(self) -> None:
        """Delete paused sessions past their retention, with everything kept for them."""
        retention = self.settings.paused_retention_s
        for listed in await self._records.paused_before(time.time() - retention):
            async with self._locks.of(listed.id):
                # Read again under its lock: resumed (and maybe paused afresh) meanwhile?
                record = await self._records.get(listed.id)
                if record is None or record.state != "paused" or self._sessions.live(record.id):
                    continue
                if record.state_since >= time.time() - retention:
                    continue
                log.info("session %s deleted after %g s paused", record.id, retention)
                await self._pauses.delete(record, f"was deleted after {retention:g} s paused")
