"""Pausing (docs/persistence.md): a session's state saved and its sandbox stopped, then brought
back into a new sandbox when a call wakes it; and a paused session deleted for good. Each runs
under the session's state lock (`StateLocks`), which its callers hold."""

from __future__ import annotations

import contextlib
import logging
import re
import time

from orchestrator.cluster.shared import FencedSaves
from orchestrator.host_tools import HostTool
from orchestrator.metrics import METRICS
from orchestrator.outputs import KeptOutputs
from orchestrator.saved_states import SavedStateQuotaReached
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.channels import Channels
from orchestrator.service_parts.errors import ResumeFailed, ToolsNotAvailable
from orchestrator.service_parts.persistence import Persistence, record_of
from orchestrator.service_parts.volumes import Volumes
from orchestrator.sessions import Session, SessionBusy, SessionManager
from orchestrator.settings_sections import ExpirySection
from orchestrator.state_store import SessionRecord, SnapshotRecord

log = logging.getLogger(__name__)

_RESUMED = "resumed"
# What a call through another replica is told while a pause takes the session.
_FENCED = "the session is being paused (through another replica); call again in a moment"
# What each restore says first; the latest one's is the one that holds.
_RESTORED_COUNTS = re.compile(r"\d+ variable\(s\) and \d+ file\(s\) restored\.?")


def pending_notice(earlier: str | None, parts: list[str]) -> str:
    """A resume's notice, with what an earlier one (or a restart, or a fork) said that no
    execution has told yet: each thing once, so repeated pauses and resumes between two
    executions do not make it grow (of the restores' counts, the latest holds)."""
    pieces: list[str] = []
    for whole in ([earlier.removeprefix(f"{_RESUMED}: ")] if earlier else []) + parts:
        for piece in whole.split("; "):
            if piece in ("", _RESUMED) or piece in pieces:
                continue
            if _RESTORED_COUNTS.fullmatch(piece):
                pieces = [p for p in pieces if not _RESTORED_COUNTS.fullmatch(p)]
            pieces.append(piece)
    return f"{_RESUMED}: " + "; ".join(pieces) if pieces else _RESUMED


class Pauses:
    def __init__(
        self,
        settings: ExpirySection,
        sessions: SessionManager,
        admission: Admission,
        channels: Channels,
        persistence: Persistence,
        trail: AuditTrail,
        outputs: KeptOutputs,
        volumes: Volumes,
    ) -> None:
        """`volumes`: what a session that resumes with volumes mounts, made ready first."""
        self.settings = settings
        self._volumes = volumes
        self._sessions = sessions
        self._admission = admission
        self._channels = channels
        self._records = persistence
        self._trail = trail
        self._outputs = outputs
        self._left_over: dict[str, str] = {}  # session -> a failed earlier pause's saved state

    async def pause(self, session: Session) -> SessionRecord:
        """Save, then stop. If the save fails, it keeps running."""
        limit = self.settings.max_paused_sessions_per_key
        if await self._records.count_paused(session.owner) >= limit:
            raise SavedStateQuotaReached(
                f"this API key keeps its maximum of {limit} paused sessions; delete one first"
            )
        session.changing += 1  # its record lags behind until this is done
        try:
            return await self._pause(session)
        finally:
            session.changing -= 1

    async def _pause(self, session: Session) -> SessionRecord:
        executions = session.executions
        saved: SnapshotRecord | None = None
        # A sandbox other replicas may change: what they did meanwhile is counted by it.
        fenced = session.sandbox if isinstance(session.sandbox, FencedSaves) else None
        mark = None
        if fenced is not None:
            async with session.reach():
                mark = await fenced.fence_mark()
        suspended = await session.sandbox.suspend()  # the engine's own pause, where it has one
        if suspended is None:
            saved = await self._records.saved.save(session, "paused")
        try:
            if saved is not None and (session.busy or session.executions != executions):
                raise SessionBusy("the session ran code while it was being paused; pause it again")
            if saved is not None and fenced is not None and mark is not None:
                async with session.reach():
                    taken = await fenced.fence(mark, _FENCED)
                if not taken:
                    fenced = None  # nothing to take back
                    raise SessionBusy(
                        "the session was used through another replica while it was being "
                        "paused; pause it again"
                    )
            record = await self._paused_record(session, saved, suspended)
        except BaseException:
            self._left_over.pop(session.id, None)  # kept: the earlier record still names it
            if fenced is not None:  # it runs on: its calls are taken again
                with contextlib.suppress(Exception):
                    await fenced.unfence()
            if saved is not None:
                with contextlib.suppress(Exception):
                    await self._records.drop_saved_state(saved.id)
            raise
        try:
            await self._sessions.release(session)
        finally:
            # After the sandbox stops, as when a session ends: its proxy's last records (the
            # connections the stop ended) are still taken, from a node too (egress_relay.py).
            await self._channels.close_for(session.id, sandbox=session.sandbox)
        left_over = self._left_over.pop(session.id, None)
        if left_over is not None:  # after the stop: a slow delete never outlasts a fence
            await self._records.drop_saved_state(left_over)
        METRICS.sessions_paused.inc()
        self._trail.paused(session, saved.bytes if saved else None, bool(suspended))
        log.info(
            "session %s paused (%s)",
            session.id,
            f"{saved.bytes} bytes saved" if saved else f"suspended by its backend as {suspended}",
        )
        return record

    async def _paused_record(
        self, session: Session, saved: SnapshotRecord | None, suspended: str | None
    ) -> SessionRecord:
        """The session's record, written paused (the state a failed earlier pause left goes,
        once the sandbox is stopped: `_left_over`)."""
        earlier = await self._records.get(session.id)  # a paused state left by a failed pause
        if (
            earlier is not None
            and earlier.saved_state
            and earlier.saved_state != (saved.id if saved else None)
        ):
            self._left_over[session.id] = earlier.saved_state
        record = record_of(session, self._channels.session_tools(session))
        record.state, record.state_since = "paused", time.time()
        record.saved_state, record.suspended, record.sandbox_id = (
            saved.id if saved else None,
            suspended,
            None,
        )
        if suspended is None:  # its sandbox stops: no replica attaches to it any more
            record.sandbox_handle = None
        record.notice = session.notice
        await self._records.put(record)
        return record

    async def resume(self, record: SessionRecord) -> Session:
        """A new sandbox, its state brought back into it. If that fails, the session stays
        paused and nothing is lost (ResumeFailed)."""
        saved = await self._records.saved_state(record.saved_state) if record.saved_state else None
        spec, notices = self._admission.fit_resumed(record)
        if spec.mounts:  # its volumes still its, on the host
            await self._volumes.ready(record.owner, spec.mounts)
        async with self._admission.session_slot(record.owner):
            session = await self._sessions.create(
                record.owner,
                backend=record.backend,
                spec=spec,
                session_id=record.id,
                wake=record.suspended,
            )
            session.changing += 1  # its record says paused until this is done
        try:
            return await self._resumed(record, session, saved, notices)
        finally:
            session.changing -= 1

    async def _resumed(
        self,
        record: SessionRecord,
        session: Session,
        saved: SnapshotRecord | None,
        notices: list[str],
    ) -> Session:
        session.created_at, session.executions = record.created_at, record.executions
        session.idle_timeout_s, session.on_idle = record.idle_timeout_s, record.on_idle
        session.labels = dict(record.labels)
        session.ports = record.ports
        session.secrets = list(record.secrets)  # bound again by name, as its key has them now
        try:
            await self._channels.open_egress(session)
            tools: dict[str, HostTool] = {}
            try:
                tools = self._channels.select(record.tools)
            except ToolsNotAvailable as exc:
                notices.append(f"its host tools are gone: {exc}")
            if tools:
                await self._channels.open_tools(session, tools)
            if saved is not None:
                restored = await self._records.saved.restore(session, saved)
                notices.append(restored.notice)
            elif record.suspended is not None:
                notices.append("its whole sandbox was paused and resumed by its backend")
            session.notice = pending_notice(record.notice, notices)
            session.state_lost = record.state_lost
            await self._records.put(record_of(session, self._channels.session_tools(session)))
        except BaseException as exc:
            if record.suspended is not None:  # paused again as it was, not killed
                await self._suspend_again(record, session)
            try:
                await self._sessions.release(session)
            finally:
                # After, as on a pause.
                await self._channels.close_for(session.id, sandbox=session.sandbox)
            if isinstance(exc, Exception):
                log.exception("session %s could not be resumed", record.id)
                raise ResumeFailed(
                    f"session {record.id} could not be resumed ({exc}); it stays paused, with "
                    "nothing lost: try again"
                ) from None
            raise
        if saved is not None:
            await self._records.drop_saved_state(saved.id)
        if record.suspended is not None:  # recorded running: what the wake kept may go
            with contextlib.suppress(Exception):
                await self._sessions.backends[record.backend].woken(record.suspended)
        METRICS.sessions_resumed.inc()
        self._trail.resumed(record.id, record.owner)
        log.info("session %s resumed", record.id)
        return session

    async def _suspend_again(self, record: SessionRecord, session: Session) -> None:
        """A resume that failed after its sandbox woke: paused again as it was, and the record
        names the new image (the one it woke from goes, where the engine kept it); if it cannot
        be paused again, the record keeps naming the image it woke from."""
        earlier = record.suspended
        backend = self._sessions.backends[record.backend]
        with contextlib.suppress(Exception):
            again = await session.sandbox.suspend()
            if again is None or again == earlier:
                return
            try:
                await self._records.put(record.model_copy(update={"suspended": again}))
            except BaseException:
                with contextlib.suppress(Exception):  # the record still names the earlier
                    await backend.discard(again)
                raise
            record.suspended = again
            if earlier is not None:
                await backend.discard(earlier)

    async def delete(self, record: SessionRecord, why: str) -> None:
        """A paused session ends for good: its record, saved state and kept outputs go."""
        await self._records.forget(record.id)
        await self._sessions.forgotten(record.id, record.owner, why)
        self._trail.ended(record.id, record.owner, why)
        await self._outputs.drop(record.id)
