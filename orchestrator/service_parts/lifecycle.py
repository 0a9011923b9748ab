"""Lifecycle: a session made, found (woken first if it was paused), listed, paused, resumed and
ended, for every front door; the only way each of these is done."""

from __future__ import annotations

import logging

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.rest import CreateSessionRequest, LimitsRequest, ResumeInfo, SessionInfo
from code_interpreter_wire.spec import DirectoryMount, SandboxSpec, mount_places
from orchestrator.cluster.shared import SharedSandbox
from orchestrator.governance.approvals import Approvals
from orchestrator.host_tools import HostTool
from orchestrator.outputs import KeptOutputs
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.channels import Channels
from orchestrator.service_parts.pausing import Pauses
from orchestrator.service_parts.persistence import Persistence, record_of
from orchestrator.service_parts.ports import Ports
from orchestrator.service_parts.state_locks import StateLocks
from orchestrator.service_parts.views import Views
from orchestrator.service_parts.volumes import Volumes
from orchestrator.service_parts.workspace import Workspace
from orchestrator.sessions import (
    Session,
    SessionBusy,
    SessionError,
    SessionManager,
    SessionNotFound,
)
from orchestrator.settings_sections import ExpirySection
from orchestrator.state_store import SessionRecord, SnapshotRecord
from orchestrator.vault.records import SecretsNotAvailable

log = logging.getLogger(__name__)


def _from_snapshot(request: CreateSessionRequest, snapshot: SnapshotRecord) -> CreateSessionRequest:
    """A request starting from a snapshot: its backend, limits, image and runtime unless the
    request says (the image and runtime are checked as if asked for)."""
    update: dict[str, object] = {}
    if request.backend is None:
        update["backend"] = snapshot.backend
    if request.limits is None:
        update["limits"] = LimitsRequest.model_validate(snapshot.spec.limits.model_dump())
    if (request.backend or snapshot.backend) == snapshot.backend:  # its image and runtime too:
        if request.image is None and snapshot.spec.image is not None:  # its modules are there
            update["image"] = snapshot.spec.image
        if request.runtime is None and snapshot.spec.runtime is not None:
            update["runtime"] = snapshot.spec.runtime
    return request.model_copy(update=update)


class SnapshotUnfit(SessionError):
    """The snapshot cannot start a session of the kind asked for."""

    status = 409


class Lifecycle:
    def __init__(
        self,
        settings: ExpirySection,
        sessions: SessionManager,
        *,
        admission: Admission,
        approvals: Approvals,
        channels: Channels,
        persistence: Persistence,
        trail: AuditTrail,
        views: Views,
        workspace: Workspace,
        pauses: Pauses,
        locks: StateLocks,
        outputs: KeptOutputs,
        ports: Ports,
        volumes: Volumes,
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        self._admission = admission
        self._approvals = approvals
        self._channels = channels
        self._records = persistence
        self._trail = trail
        self._views = views
        self._workspace = workspace
        self._pauses = pauses
        self._locks = locks
        self._outputs = outputs
        self._ports = ports
        self._volumes = volumes

    # --- made
    async def create(
        self,
        owner: str,
        request: CreateSessionRequest,
        *,
        idle_timeout_s: float | None = None,
        spec: SandboxSpec | None = None,
        workdir: str | None = None,
        tools_within_policy: bool = False,
        ports_if_offered: bool = False,
        ports_token: str | None = None,
    ) -> Session:
        """A new session for `owner`: the only way one is made. `idle_timeout_s`: an expiry of
        its own (sooner than the service's), for sessions a client may forget. `spec`: a whole
        spec from in-process code (an embedded session's), taken as it is, past the ceilings a
        request is held to. `workdir`: where its kernels run (`SandboxSpec.workdir`; the E2B
        front's are in E2B's home), set after the sandbox is had, so a pooled one fits too.
        `tools_within_policy`: the host tools its key's policy does not allow are left out,
        not refused (a model tool's own session, whose tools nobody asked for).
        `ports_if_offered`: the ports asked for are left out where the operator or the backend
        gives none, not refused (E2B's sandboxes, which always have them where they can).
        `ports_token`: the token its ports take (a front's own secret for the sandbox, E2B's
        access token); else one is made."""
        if tools_within_policy:
            allowed = self._admission.allowed_tools(owner, request.tools)
            request = request.model_copy(update={"tools": allowed})
        tools = self._channels.select(request.tools)
        # Refused before a sandbox is made for it, and kept from deletion until restored.
        async with self._records.pinned(owner, request.snapshot_id) as snapshot:
            if snapshot is not None:
                request = _from_snapshot(request, snapshot)
            return await self._create(
                owner,
                request,
                tools,
                snapshot,
                idle_timeout_s,
                spec,
                workdir,
                (ports_if_offered, ports_token),
            )

    async def _create(
        self,
        owner: str,
        request: CreateSessionRequest,
        tools: dict[str, HostTool],
        snapshot: SnapshotRecord | None,
        idle_timeout_s: float | None,
        spec: SandboxSpec | None,
        workdir: str | None,
        ports_asked: tuple[bool, str | None],
    ) -> Session:
        name, spec = await self._admission.admit(
            owner, request, spec, tools=bool(tools), from_snapshot=snapshot is not None
        )
        machine = self._records.saved.whole_machine(snapshot) if snapshot is not None else None
        if snapshot is not None and machine is not None and name != snapshot.backend:
            raise SnapshotUnfit(
                f"snapshot {snapshot.id} is a whole {snapshot.backend} sandbox: start it on the "
                f"{snapshot.backend} backend (leave `backend` out of the request)"
            )
        # Refused before a sandbox is made.
        if_offered, token = ports_asked
        ports = self._ports.access_for(name, request.ports, if_offered=if_offered, token=token)
        backend = self._sessions.backends.get(name)
        if request.secrets and (backend is None or not backend.capabilities.egress_files):
            raise SecretsNotAvailable(
                f"sessions of the {name} backend cannot have secrets: their egress proxy is not "
                "this service's, or their sandbox cannot read the CA it signs with; use one "
                "whose sessions can (docs/secrets.md, Backends)"
            )
        # Placeholders only: the values stay with its proxy (orchestrator/vault/).
        secret_env = await self._channels.secrets_env(owner, request.secrets, spec.network)
        mounts_possible = backend is not None and backend.capabilities.mounts
        async with self._volumes.reserved(owner, mounts_possible, request.volumes) as mounts:
            if snapshot is not None and machine is not None:
                _same_volume_places(snapshot, mounts)
            if mounts:
                spec = spec.model_copy(update={"mounts": mounts})
            async with self._admission.session_slot(owner):
                session = await self._sessions.create(
                    owner, backend=name, spec=spec, env=request.env | secret_env, fork=machine
                )
            try:
                await self._volumes.hold(session.id, owner, request.volumes)
            except BaseException:
                await self._sessions.delete(session.id, owner)
                raise
        session.ports = ports
        session.secrets = list(dict.fromkeys(request.secrets))
        self._trail.created(session, list(tools), snapshot.id if snapshot is not None else None)
        session.idle_timeout_s = idle_timeout_s
        try:
            async with session.reach():
                await self._channels.open_egress(session)
                if workdir is not None and workdir != session.sandbox.spec.workdir:
                    await session.sandbox.set_workdir(workdir)
                if tools:
                    await self._channels.open_tools(session, tools)
                if snapshot is not None and machine is not None:
                    session.notice = (
                        f"started from snapshot {snapshot.id}: the whole sandbox as it was "
                        "(every kernel's variables, the processes still running, the files)"
                    )
                elif snapshot is not None:
                    restored = await self._records.saved.restore(session, snapshot)
                    session.notice = f"started from snapshot {snapshot.id}: {restored.notice}"
                for f in request.files:
                    await self._workspace.upload(session, f.path, f.content_base64)
            if idle_timeout_s is not None:  # a session a client may forget ends, not kept
                session.on_idle = "end"
            # In the try: a store that fails here leaves no sandbox running that no record names.
            await self._records.put(record_of(session, self._channels.session_tools(session)))
        except BaseException:  # a caller that left (cancelled) leaves no session behind
            await self._sessions.delete(session.id, owner)
            raise
        return session

    def within_lifetime(self, seconds: float) -> float:
        """A deadline a front sets on a session (E2B's sandbox timeout), no later than the
        session's longest life."""
        return float(min(seconds, self.settings.max_lifetime_s))

    async def set_labels(self, session: Session, labels: dict[str, str]) -> None:
        """Keep a front's own data with a session (E2B's metadata, its timeout): it outlives
        pauses and restarts with the session's record."""
        before, session.labels = session.labels, dict(labels)
        await self._records.set_labels(session, before)

    # --- found
    async def get(self, session_id: str, owner: str) -> Session:
        """The owner's session, resumed first if it was paused (the call that finds it paused
        wakes it); else SessionNotFound/SessionExpired (another key's session is reported
        exactly like a missing one)."""
        live = self._sessions.live(session_id)
        if live is not None and session_id not in self._locks:
            try:
                return await self._sessions.get(session_id, owner)
            except SessionNotFound:
                if self._sessions.live(session_id) is not None:
                    raise
                # Its copy here was dropped: paused (or moved) through another replica.
        async with self._locks.of(session_id):
            record = await self._paused(session_id, owner)
            if record is not None:
                return await self._pauses.resume(record)
            return await self._sessions.get(session_id, owner)

    async def _paused(self, session_id: str, owner: str) -> SessionRecord | None:
        """The owner's session if it is paused (under its state lock): not live here, or live
        here only as a stale copy (a shared session paused through another replica: the copy
        is let go)."""
        live = self._sessions.live(session_id)
        if live is not None and not self._sessions.shared(live.backend):
            return None  # a session of this machine: what is live here is the truth
        record = await self._records.paused(session_id, owner)
        if record is not None and live is not None:
            if live.changing:
                return None
            self._sessions.drop(session_id)
        return record

    async def state(self, session_id: str, owner: str) -> Session | SessionRecord | None:
        """The owner's session as it is now, without waking it: live, paused, or None. In
        cluster mode a running session another replica made is attached (found in the store)."""
        live = self._sessions.live(session_id)
        if live is not None and live.owner == owner and not self._may_be_stale(live):
            return live
        if live is not None and live.owner == owner:  # a shared copy: as its record has it
            record = await self._records.get(session_id)
            if record is None or not record.names_another_than(live.sandbox.handle):
                return live
            self._sessions.drop(session_id)
        paused = await self._records.paused(session_id, owner)
        live = self._sessions.live(session_id)  # resumed here while the store answered
        if live is not None and live.owner == owner:
            return live
        if paused is not None or live is not None or not self._sessions.clustered:
            return paused
        try:  # the caller asks describe why, when it wants to say
            return await self._sessions.get(session_id, owner)
        except SessionError:
            return None

    async def describe(self, session_id: str, owner: str) -> SessionInfo:
        """What a session is, running or paused, without waking it."""
        found = await self.state(session_id, owner)
        if isinstance(found, SessionRecord):
            return self._views.paused_info(found)
        session = await self._sessions.get(session_id, owner)
        return await self._shared_idle(session, self._views.info(session))

    async def _shared_idle(self, session: Session, info: SessionInfo) -> SessionInfo:
        """A shared session's idle expiry as its sandbox counts it for every replica (this
        replica's own clock misses the calls made through the others)."""
        shared = session.sandbox
        if not isinstance(shared, SharedSandbox):
            return info
        try:
            idle_s, in_flight = await shared.activity()
        except SandboxError:  # lost: the next call that needs it says so
            return info
        timeout = session.idle_timeout_s or self.settings.idle_timeout_s
        left = timeout if in_flight else max(0.0, timeout - idle_s)
        return info.model_copy(update={"idle_expires_in_s": left})

    async def keepalive(self, session: Session) -> SessionInfo:
        """Mark the session active: its idle expiry starts again (for a shared session, in its
        sandbox, whose activity every replica's reaper reads)."""
        async with session.reach():  # a lost one ends here, answered SessionLost
            if isinstance(session.sandbox, SharedSandbox):
                await session.sandbox.touch()
        return self._views.info(session)

    # --- listed
    def running(self, owner: str) -> list[Session]:
        """The owner's sessions running here."""
        return self._sessions.list(owner)

    async def list_paused(self, owner: str | None) -> list[SessionRecord]:
        """The owner's paused sessions; None: every owner's (a front finding its own records
        again when it starts)."""
        return await self._records.list_paused(owner)

    async def infos(self, owner: str) -> list[SessionInfo]:
        """Every session of the owner's, running and paused (in cluster mode: those every
        replica serves, from the shared store)."""
        return [info for _, info in await self.owned_infos(owner)]

    async def owned_infos(self, owner: str | None) -> list[tuple[str, SessionInfo]]:
        """(owner, info) of each session `infos` lists; None: every owner's (an admin's view in
        the console, polled every few seconds). Wakes nothing. The store is read first (Redis
        may take up to its timeout), then the sessions in memory."""
        records = await self._records.listed(owner)
        live = self._sessions.all() if owner is None else self._sessions.list(owner)
        recorded = {r.id: r for r in records}
        # A shared copy here that its record shows paused (or moved) is listed as recorded.
        live = [x for x in live if not self._stale(x, recorded.get(x.id))]
        found = [(x.owner, self._views.info(x)) for x in live]
        held = {x.id for x in live}
        for record in records:
            if record.id in held:  # live here (resumed while the store answered), or listed
                continue
            held.add(record.id)
            found.append((record.owner, self._views.record_info(record)))
        return found

    async def owned_info(
        self, owner: str | None, session_id: str
    ) -> tuple[str, SessionInfo] | None:
        """(owner, info) of one session `owned_infos` would list, or None; its record read
        only when it is not live here."""
        found = self._live_info(owner, session_id)
        if found is not None or not session_id.startswith("s-"):
            return found
        record = await self._records.get(session_id)
        found = self._live_info(owner, session_id)  # resumed here while the store answered
        if found is not None or record is None or owner not in (None, record.owner):
            return found
        if record.state == "paused":
            return record.owner, self._views.paused_info(record)
        if self._sessions.clustered and record.state == "running":  # another replica's
            return record.owner, self._views.running_info(record)
        return None

    def _stale(self, session: Session, record: SessionRecord | None) -> bool:
        """Whether this copy of a shared session is not the one its record names."""
        if record is None or not self._may_be_stale(session):
            return False
        return record.names_another_than(session.sandbox.handle)

    def _may_be_stale(self, session: Session) -> bool:
        """A copy of a session every replica serves, not being changed here: another replica
        may have paused it (or resumed it elsewhere) since."""
        return self._sessions.shared(session.backend) and session.changing == 0

    def _live_info(self, owner: str | None, session_id: str) -> tuple[str, SessionInfo] | None:
        live = self._sessions.live(session_id)
        if live is None or owner not in (None, live.owner):
            return None
        return live.owner, self._views.info(live)

    # --- paused, resumed, ended
    async def pause(self, session_id: str, owner: str) -> SessionInfo:
        """Save a session's variables and files and stop its sandbox: it holds no process until
        the next call (or `resume`) wakes it. Pausing a paused session changes nothing.
        SessionBusy while it runs code."""
        async with self._locks.of(session_id):
            record = await self._paused(session_id, owner)
            if record is not None:
                return self._views.paused_info(record)
            session = await self._sessions.get(session_id, owner)
            self._admission.check_pause(session)
            if session.busy:
                raise SessionBusy(
                    "the session is running code: wait for it, or interrupt it, then pause"
                )
            return self._views.paused_info(await self._pauses.pause(session))

    async def resume(self, session_id: str, owner: str) -> ResumeInfo:
        """Wake a paused session now (a running one is left as it is)."""
        async with self._locks.of(session_id):
            record = await self._paused(session_id, owner)
            if record is None:
                session = await self._sessions.get(session_id, owner)
                return ResumeInfo(session=self._views.info(session))
            session = await self._pauses.resume(record)
            return ResumeInfo(session=self._views.info(session), notice=session.notice)

    async def end(self, session_id: str, owner: str) -> None:
        """End a session and its sandbox, running or paused; its kept outputs and paused state
        go with it."""
        async with self._locks.of(session_id):
            record = await self._paused(session_id, owner)
            if record is None:
                await self._sessions.delete(session_id, owner)
                return
            await self._pauses.delete(record, "was deleted")

    async def ended(self, session_id: str) -> None:
        """Told by the session manager as each session ends: what is kept for it goes."""
        self._approvals.abandon_session(session_id)  # what waits for a human in it goes now
        self._trail.input.forget_session(session_id)
        ended = self._sessions.why_ended(session_id)
        if ended is not None:  # None: another replica ended it, and recorded it
            self._trail.ended(session_id, *ended)
        if self._records.started:
            await self._records.forget(session_id)
        # Off the loop: it may wait for a save writing a large execution, then delete files.
        await self._outputs.drop(session_id)
        await self._channels.close_for(session_id)
        await self._ports.ended(session_id)
        await self._volumes.released(session_id)
        # Last (a store that fails delays none of the above): the waits of other replicas.
        try:
            await self._approvals.abandon_session_elsewhere(session_id)
        except Exception:
            log.warning(
                "the approval requests of ended session %s could not be ended on other "
                "replicas; they end at their time limit",
                session_id,
                exc_info=True,
            )


def _same_volume_places(snapshot: SnapshotRecord, mounts: list[DirectoryMount]) -> None:
    """A whole saved sandbox keeps its mount table: started from it, a session mounts volumes
    at the places (and read-only as) it had them, or is refused before a sandbox is made."""
    saved = mount_places(snapshot.spec.mounts)
    if mount_places(mounts) == saved:
        return
    whole = f"snapshot {snapshot.id} is a whole sandbox"
    if not saved:
        raise SnapshotUnfit(f"{whole} that had no volumes: start it without `volumes`")
    had = ", ".join(f"{path} ({'read-only' if ro else 'read-write'})" for path, ro in saved)
    raise SnapshotUnfit(
        f"{whole} that had volumes mounted at {had}: start it with `volumes` at those places, "
        "read-only as they were (the volumes may be others)"
    )
