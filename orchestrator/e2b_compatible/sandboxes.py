"""E2B sandboxes are our sessions: what E2B adds to a session is kept here.

An E2B sandbox's id is its session's id. E2B adds an access token (checked on every data-plane
call, so one key's sandbox cannot be reached with another's), a template name, metadata, a
deadline (E2B's `timeout`: the sandbox is killed, or paused with `lifecycle.on_timeout: pause`,
that long after creation or the last `set_timeout`, whatever its activity; until then the idle
expiry does not end it), and the code contexts made beside the default one, each a session of its
own (see contexts.py).

Pausing a sandbox pauses its sessions (the service saves their variables and files and stops
their sandboxes); connecting resumes them. The record is kept with the session's durable record
(`Service.set_labels`), so a paused sandbox is found again after the service restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import BaseModel, ValidationError

from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.rest import CreateSessionRequest
from code_interpreter_wire.volumes import VolumeMount
from orchestrator.auth import LOCAL_OWNER
from orchestrator.governance.errors import PolicyDenied
from orchestrator.service import Service
from orchestrator.sessions import (
    Session,
    SessionBusy,
    SessionError,
    SessionLimitReached,
    SessionNotFound,
)
from orchestrator.state_store.records import SessionRecord

log = logging.getLogger(__name__)

# The id the SDK uses for every sandbox when E2B_DEBUG is set (it then skips the control plane
# and sends no credentials): served only by a service whose auth is disabled.
DEBUG_SANDBOX_ID = "debug_sandbox_id"
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout
# Cluster mode: how often a signed URL no known sandbox signed may make this replica read every
# replica's sandboxes from the store (one made elsewhere a moment ago is then found).
ADOPT_ALL_EVERY_S = 2.0
# E2B's home, every context's working directory unless one is asked for; in our sandboxes it is
# a link to the workspace, so files there and in the workspace are the same files.
E2B_HOME = "/home/user"
# The id E2B's server also answers to for the default Python context.
DEFAULT_CONTEXT = "default"
_CONTEXT_IDS = uuid.UUID("9a4c1f0e-5b7d-4f43-8d8e-2f6a1c3b7e51")
# The labels a sandbox's record is kept under, with its session's durable record.
SANDBOX_LABEL = "e2b.sandbox"
CONTEXT_LABEL = "e2b.context_of"  # on a context's session: the sandbox it belongs to


class SandboxPaused(SessionError):
    """A control-plane call that needs a running sandbox named a paused one."""

    status = 409

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} is paused: connect to it to resume it first")


# Why a sandbox that is there may not be woken (a key's policy: `max_sessions`, a backend it may
# no longer use, a revoked key; the service's cap of sessions per key): said as such, never as a
# sandbox that is gone.
REFUSALS = (PolicyDenied, SessionLimitReached)


class SandboxGone(Exception):
    """A data-plane call named a sandbox that does not exist, ended, or is another key's."""

    def __init__(self, sandbox_id: str) -> None:
        # E2B's proxy says exactly this; the SDK recognises "was not found".
        super().__init__(f"The sandbox {sandbox_id} was not found")
        self.sandbox_id = sandbox_id


@dataclass
class Context:
    """A code context made beside the default ones: a kernel in a session of its own."""

    id: str  # its session's id
    cwd: str | None
    language: str


@dataclass
class E2BRecord:
    sandbox_id: str
    session_id: str
    owner: str
    token: str | None  # None: the debug sandbox, which E2B's SDK reaches without one
    template: str
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    deadline: float | None = None  # time.time() when E2B's timeout kills it; None: idle expiry
    contexts: dict[str, Context] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S  # the last asked: what an auto-resume arms again
    auto_pause: bool = False  # lifecycle.on_timeout "pause": the timeout pauses, not kills
    auto_resume: bool = False  # lifecycle.auto_resume: data-plane traffic resumes it
    # Paused by E2B's pause or its timeout (not by the service's shutdown or idle expiry, which
    # its next traffic undoes, as if it had never been paused).
    paused_on_purpose: bool = False
    seen_paused: bool = False  # the sweep saw it paused: if it runs again, its timeout restarts
    # Created with E2B's `secure: false` (its v1 SDK's default): its code interpreter's routes
    # take its ports' traffic (public, or with the traffic token) without the access token.
    open_code_port: bool = False
    pausing: bool = False  # a pause is under way: the sweep leaves it alone
    # Its volumes (E2B's volumeMounts): its contexts' sessions mount them too, as on E2B.
    volumes: list[VolumeMount] = field(default_factory=list)

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.time() + timeout_s

    def default_context_id(self, language: str) -> str:
        """The id of the sandbox's default context of `language`: a UUID like the kernel id E2B
        gives it, stable for the sandbox's life, so a listed id can be run in and restarted."""
        return str(uuid.uuid5(_CONTEXT_IDS, f"{self.sandbox_id}/{language}"))

    def default_context_language(self, context_id: str, languages: list[str]) -> str | None:
        """The language whose default context `context_id` names, if it names one."""
        if context_id in (DEFAULT_CONTEXT, self.sandbox_id):
            return PYTHON
        return next((x for x in languages if self.default_context_id(x) == context_id), None)


class _SavedContext(BaseModel):
    id: str
    cwd: str | None
    language: str


class _SavedRecord(BaseModel):
    """What of a record outlives the process: kept as a label of its session's record. The
    token too: a client holds it, and E2B's resume keeps it."""

    token: str
    template: str
    metadata: dict[str, str]
    started_at: datetime
    deadline: float | None
    timeout_s: float
    auto_pause: bool
    auto_resume: bool
    paused_on_purpose: bool
    contexts: list[_SavedContext]
    open_code_port: bool = False
    volumes: list[VolumeMount] = []


def _saved(record: E2BRecord) -> str:
    return _SavedRecord(
        token=record.token or "",
        template=record.template,
        metadata=record.metadata,
        started_at=record.started_at,
        deadline=record.deadline,
        timeout_s=record.timeout_s,
        auto_pause=record.auto_pause,
        auto_resume=record.auto_resume,
        paused_on_purpose=record.paused_on_purpose,
        open_code_port=record.open_code_port,
        volumes=record.volumes,
        contexts=[
            _SavedContext(id=c.id, cwd=c.cwd, language=c.language) for c in record.contexts.values()
        ],
    ).model_dump_json()


def _restored(session_id: str, owner: str, labels: dict[str, str]) -> E2BRecord | None:
    """The record kept in a session's labels, if it has one that reads."""
    text = labels.get(SANDBOX_LABEL)
    if text is None:
        return None
    try:
        kept = _SavedRecord.model_validate_json(text)
    except ValidationError:
        log.warning("the E2B record of session %s does not read; it is a plain one", session_id)
        return None
    return E2BRecord(
        sandbox_id=session_id,
        session_id=session_id,
        owner=owner,
        token=kept.token,
        template=kept.template,
        metadata=kept.metadata,
        started_at=kept.started_at,
        deadline=kept.deadline,
        contexts={c.id: Context(id=c.id, cwd=c.cwd, language=c.language) for c in kept.contexts},
        timeout_s=kept.timeout_s,
        auto_pause=kept.auto_pause,
        auto_resume=kept.auto_resume,
        paused_on_purpose=kept.paused_on_purpose,
        open_code_port=kept.open_code_port,
        volumes=kept.volumes,
    )


# A sandbox as it is now: its running session, or the record of its paused one.
Found = Session | SessionRecord


def _signs(record: E2BRecord, signed_with: Callable[[str], bool]) -> bool:
    return record.token is not None and signed_with(record.token)


class E2BSandboxes:
    """The E2B view of the service's sessions, and the clock of E2B's timeouts."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._records: dict[str, E2BRecord] = {}  # by sandbox id
        # Cluster mode: the store is the truth of every sandbox's record (any replica may set
        # its timeout or add a context); this replica's records are a cache of it.
        self._clustered = service.persistence.clustered
        self._cursor = 0  # where the sweep's walk over the store goes on from
        self._context_sessions: set[str] = set()
        self._debug_lock = asyncio.Lock()
        self._adopt_all_lock = asyncio.Lock()
        self._adopted_all_at = -ADOPT_ALL_EVERY_S

    # ----------------------------------------------------------------------------------------

    def add(
        self,
        session: Session,
        *,
        template: str,
        metadata: dict[str, str],
        auto_pause: bool = False,
        auto_resume: bool = False,
        open_code_port: bool = False,
        token: str | None = None,
    ) -> E2BRecord:
        """`token`: its access token (made here if not given; the create gives the one its
        session's ports were given, so one secret opens the sandbox as on E2B)."""
        record = E2BRecord(
            sandbox_id=session.id,
            session_id=session.id,
            owner=session.owner,
            token=token or secrets.token_urlsafe(32),
            template=template,
            metadata=metadata,
            started_at=datetime.fromtimestamp(session.created_at, UTC),
            auto_pause=auto_pause,
            auto_resume=auto_resume,
            open_code_port=open_code_port,
        )
        self._records[session.id] = record
        return record

    async def keep(self, record: E2BRecord, session: Session) -> None:
        """Keep the record with its (running) session's durable record: what a pause and a
        restart of the service must not lose."""
        if record.token is None:  # the debug sandbox lives and dies with the process
            return
        await self.service.lifecycle.set_labels(
            session, {**session.labels, SANDBOX_LABEL: _saved(record)}
        )

    async def keep_if_running(self, record: E2BRecord) -> None:
        found = await self.service.lifecycle.state(record.session_id, record.owner)
        if isinstance(found, Session):
            await self.keep(record, found)

    async def add_context(
        self, record: E2BRecord, session: Session, cwd: str | None, language: str
    ) -> Context:
        context = Context(id=session.id, cwd=cwd, language=language)
        record.contexts[context.id] = context
        self._context_sessions.add(session.id)
        await self.service.lifecycle.set_labels(
            session, {**session.labels, CONTEXT_LABEL: record.sandbox_id}
        )
        await self.keep_if_running(record)
        return context

    def is_live(self, record: E2BRecord) -> bool:
        """Whether the sandbox is still tracked (not killed, timed out or forgotten)."""
        return self._records.get(record.sandbox_id) is record

    def is_context(self, session_id: str) -> bool:
        return session_id in self._context_sessions

    async def rebuild(self) -> int:
        """Records of the sandboxes a previous process left paused (a restart pauses or
        salvages every session): found by their session's labels. Returns how many."""
        made = 0
        for kept in await self.service.lifecycle.list_paused(None):
            if kept.id in self._records or CONTEXT_LABEL in kept.labels:
                continue
            record = _restored(kept.id, kept.owner, kept.labels)
            if record is not None:
                record.seen_paused = True
                self._adopt(record)
                made += 1
        return made

    def _adopt(self, record: E2BRecord) -> None:
        self._records[record.sandbox_id] = record
        self._context_sessions.update(record.contexts)

    async def _from_store(self, sandbox_id: str) -> E2BRecord | None:
        """Cluster mode: the record of a running sandbox another replica made (or changed),
        as kept in its session's labels in the shared store; adopted, or merged into the one
        cached here. None outside cluster mode, or when the store has none."""
        if not self._clustered or not sandbox_id.startswith("s-"):
            return None
        kept = await self.service.persistence.get(sandbox_id)
        if kept is None or kept.state != "running" or CONTEXT_LABEL in kept.labels:
            return None
        return self._merge(_restored(kept.id, kept.owner, kept.labels))

    def _merge(self, fresh: E2BRecord | None) -> E2BRecord | None:
        """Take what another replica may have changed (its timeout, contexts, metadata) from
        the store's copy; what is under way here (a pause) stays this replica's."""
        if fresh is None:
            return None
        cached = self._records.get(fresh.sandbox_id)
        if cached is None or cached.token != fresh.token:
            self._adopt(fresh)
            return fresh
        cached.deadline, cached.timeout_s = fresh.deadline, fresh.timeout_s
        cached.metadata = fresh.metadata
        cached.contexts = fresh.contexts
        self._context_sessions.update(fresh.contexts)
        return cached

    def _record_for(self, found: Found) -> E2BRecord:
        """The record of a session not tracked yet: its kept one, or a new one (a session made
        through /v1 is an E2B sandbox too, once asked for)."""
        record = _restored(found.id, found.owner, found.labels)
        if record is None:
            record = E2BRecord(
                sandbox_id=found.id,
                session_id=found.id,
                owner=found.owner,
                token=secrets.token_urlsafe(32),
                template=found.backend,
                started_at=datetime.fromtimestamp(found.created_at, UTC),
            )
        self._adopt(record)
        return record

    async def found(self, sandbox_id: str, owner: str) -> tuple[E2BRecord, Found]:
        """For the control plane: the caller's sandbox as it is, running or paused, without
        waking it; or SessionNotFound/SessionExpired."""
        record = self._records.get(sandbox_id)
        session_id = record.session_id if record else sandbox_id
        if self.is_context(session_id):
            raise SessionNotFound(f"no sandbox {sandbox_id}")
        if self._clustered:
            record = await self._from_store(session_id) or record
        found = await self.service.lifecycle.state(session_id, owner)
        if found is None:
            try:  # the service says why: expired, or never (another key's is not found)
                await self.service.lifecycle.describe(session_id, owner)
            except SessionError:
                if record is not None and record.owner == owner:
                    await self.forget(record)
                raise
            raise SessionNotFound(f"no session {sandbox_id}")
        if record is None:
            record = self._record_for(found)
        return record, found

    async def owned(self, sandbox_id: str, owner: str) -> tuple[E2BRecord, Session]:
        """For the control plane: the caller's running sandbox (SandboxPaused if paused)."""
        record, found = await self.found(sandbox_id, owner)
        if not isinstance(found, Session):
            raise SandboxPaused(sandbox_id)
        return record, found

    async def reachable(
        self, sandbox_id: str, token: str | None, *, port_traffic: bool = False
    ) -> tuple[E2BRecord, Session]:
        """For the data plane: the sandbox this token opens, or SandboxGone. A paused one is
        gone, as on E2B, unless its traffic resumes it (auto-resume, or a pause that was the
        service's own). `port_traffic`: a call to the code interpreter's port (49999: run code,
        contexts), which may be open without the token (`_open_to`). E2B's SDK sends its
        traffic token to the contexts' routes: a sandbox's traffic token is its access token."""
        record = self._records.get(sandbox_id)
        if self._clustered:  # made, or changed, through another replica
            record = await self._from_store(sandbox_id) or record
        if record is None and sandbox_id == DEBUG_SANDBOX_ID:
            record = await self._debug_record()
        if record is None:
            raise SandboxGone(sandbox_id)
        opened = record.token is None or hmac.compare_digest(
            (token or "").encode(), record.token.encode()
        )
        tokenless = not opened and port_traffic and await self._open_to(record)
        if not opened and not tokenless:
            raise SandboxGone(sandbox_id)  # like a missing one: ids are not confirmed
        if record.pausing and record.paused_on_purpose and not record.auto_resume:
            # Being paused: gone already, rather than woken the moment the pause is done.
            raise SandboxGone(sandbox_id)
        found = await self.service.lifecycle.state(record.session_id, record.owner)
        if isinstance(found, SessionRecord):
            # A call without the token never wakes it: only its holder's traffic does.
            if tokenless or (record.paused_on_purpose and not record.auto_resume):
                raise SandboxGone(sandbox_id)
            try:
                return record, await self.resume(record, None)
            except REFUSALS:
                raise  # it is there, asleep: its key may not wake it now, and is told why
            except SessionError:
                raise SandboxGone(sandbox_id) from None
        try:
            session = await self.service.lifecycle.get(record.session_id, record.owner)
        except REFUSALS:
            raise
        except SessionError:
            await self.forget(record)
            raise SandboxGone(sandbox_id) from None
        return record, session

    async def _open_to(self, record: E2BRecord) -> bool:
        """Whether the code interpreter's port takes a call without the access token: only for
        a sandbox made `secure: false` where the operator honours that (E2B's v1 SDK, whose
        code interpreter sends no token), while its ports are public."""
        if not record.open_code_port:
            return False
        found = await self.service.lifecycle.state(record.session_id, record.owner)
        ports = found.ports if found is not None else None
        return ports is not None and ports.public

    async def signed_by(
        self, signed_with: Callable[[str], bool], named: str | None, hint: str | None
    ) -> E2BRecord | None:
        """The sandbox whose access token made a signed URL's signature (`signed_with` says
        whether a token did): only `named`, if the request names one; else `hint` first, then
        every one this replica knows, then (cluster mode) every replica's, read again from the
        store at most every ADOPT_ALL_EVERY_S. None: no sandbox."""
        if named is not None:
            record = self._records.get(named)
            if self._clustered:
                record = await self._from_store(named) or record
            return record if record is not None and _signs(record, signed_with) else None
        hinted = self._records.get(hint) if hint is not None else None
        if hinted is not None and _signs(hinted, signed_with):
            return hinted
        found = next((r for r in self._records.values() if _signs(r, signed_with)), None)
        if found is None and self._clustered and await self._adopt_all_shared():
            found = next((r for r in self._records.values() if _signs(r, signed_with)), None)
        return found

    async def _adopt_all_shared(self) -> bool:
        """Cluster mode: every running E2B sandbox in the store adopted here (whichever replica
        made it), unless that was done less than ADOPT_ALL_EVERY_S ago (a burst of guessed
        signatures walks the store once). Whether a walk was made now."""
        async with self._adopt_all_lock:
            if time.monotonic() - self._adopted_all_at < ADOPT_ALL_EVERY_S:
                return False
            cursor = 0
            while True:
                cursor, records = await self.service.persistence.scan(cursor)
                for kept in records:
                    if kept.state == "running" and CONTEXT_LABEL not in kept.labels:
                        self._merge(_restored(kept.id, kept.owner, kept.labels))
                if cursor == 0:
                    break
            self._adopted_all_at = time.monotonic()
            return True

    async def _debug_record(self) -> E2BRecord | None:
        """The sandbox of E2B_DEBUG clients, made on first use; only when auth is disabled."""
        if not self.service.admission.auth_disabled:
            return None
        async with self._debug_lock:
            record = self._records.get(DEBUG_SANDBOX_ID)
            if record is not None:
                return record
            session = await self.service.lifecycle.create(
                LOCAL_OWNER, CreateSessionRequest(), workdir=E2B_HOME
            )
            record = E2BRecord(
                sandbox_id=DEBUG_SANDBOX_ID,
                session_id=session.id,
                owner=LOCAL_OWNER,
                token=None,
                template=session.backend,
            )
            self._records[DEBUG_SANDBOX_ID] = record
            return record

    async def listed(self, owner: str) -> list[str]:
        """The ids of the caller's sessions, running and paused, that are sandboxes (not
        contexts of one); the store is read off the event loop."""
        infos = await self.service.lifecycle.infos(owner)
        return [x.id for x in infos if not self.is_context(x.id)]

    # ----------------------------------------------------------------------------------------
    # pause and resume

    async def pause(self, record: E2BRecord, session: Session) -> None:
        """Pause the sandbox's session, then its contexts' (SessionBusy while it runs code).
        A context that cannot be paused runs on; it is woken by its next use anyway."""
        if session.busy:
            raise SessionBusy(
                "the sandbox is running code: wait for it, or interrupt it, then pause"
            )
        record.paused_on_purpose = record.pausing = True
        try:
            await self.keep(record, session)
            await self.service.lifecycle.pause(record.session_id, record.owner)
        except BaseException:
            record.paused_on_purpose = False
            await self.keep_if_running(record)
            raise
        finally:
            record.pausing = False
        for context in list(record.contexts.values()):
            try:
                await self.service.lifecycle.pause(context.id, record.owner)
            except SessionError as exc:
                log.warning(
                    "context %s of %s was not paused: %s", context.id, record.sandbox_id, exc
                )

    async def resume(self, record: E2BRecord, timeout_s: float | None) -> Session:
        """Resume the sandbox's session and arm its timeout again (`timeout_s`, or None: its
        last one, if it has an E2B timeout at all; a /v1 session keeps its idle expiry); its
        contexts wake on their next use (the service resumes a paused session on the call
        that finds it)."""
        await self.service.lifecycle.resume(record.session_id, record.owner)
        session = await self.service.lifecycle.get(record.session_id, record.owner)
        record.paused_on_purpose = record.seen_paused = False
        if timeout_s is not None:
            record.set_timeout(timeout_s)
        elif record.deadline is not None:
            record.set_timeout(record.timeout_s)
        await self.keep(record, session)
        return session

    async def kill(self, record: E2BRecord) -> None:
        """End the sandbox's session and every context's, running or paused (their saved
        state goes with them)."""
        await self.forget(record)
        with contextlib.suppress(SessionError):
            await self.service.lifecycle.end(record.session_id, record.owner)

    async def forget(self, record: E2BRecord) -> None:
        """Drop the record of an ended sandbox, ending its contexts' sessions."""
        self._records.pop(record.sandbox_id, None)
        for context in list(record.contexts.values()):
            await self.remove_context(record, context)

    async def remove_context(self, record: E2BRecord, context: Context) -> None:
        record.contexts.pop(context.id, None)
        self._context_sessions.discard(context.id)
        if self.is_live(record):  # out of the store's copy first: no refresh brings it back
            await self.keep_if_running(record)
        with contextlib.suppress(SessionError):
            await self.service.lifecycle.end(context.id, record.owner)

    # ----------------------------------------------------------------------------------------
    # E2B's timeouts

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Find the sandboxes a previous process left paused, then sweep while the service
        runs."""
        found = await self.rebuild()
        if found:
            log.info("found %d paused E2B sandboxes from before a restart", found)
        async with self.service.deadlines.rounds(self.sweep):  # the service's one sweeper
            yield

    async def sweep(self) -> int:
        """Hand each running sandbox with a timeout to the service's deadline rules (killed,
        or with auto-pause paused, past it; kept alive before it); return how many ended or
        paused. A paused one's timeout does not run."""
        ended = 0
        await self._adopt_shared()
        for record in list(self._records.values()):
            if record.pausing:
                continue
            if self._clustered:  # its deadline as set through any replica
                await self._from_store(record.sandbox_id)
            found = await self.service.lifecycle.state(record.session_id, record.owner)
            if found is None:
                await self.forget(record)
                ended += 1
                continue
            if not isinstance(found, Session):
                record.seen_paused = True
                continue
            if record.seen_paused or record.paused_on_purpose:
                # Woken by another door (a /v1 call, the service's lazy resume): its timeout
                # starts again, as a connect's would, rather than ending it at once. One that
                # never had an E2B timeout (a /v1 session the front only listed) gets none:
                # the service's idle expiry still governs it.
                record.paused_on_purpose = record.seen_paused = False
                if record.deadline is not None:
                    record.set_timeout(record.timeout_s)
                await self.keep(record, found)
            outcome = await self.service.deadlines.enforce(
                found,
                record.deadline,
                action="pause" if record.auto_pause else "end",
                linked=[context.id for context in record.contexts.values()],
                pause=functools.partial(self.pause, record, found),
                end=functools.partial(self.kill, record),
                name=f"E2B sandbox {record.sandbox_id}",
            )
            if outcome in ("paused", "ended", "later"):
                ended += 1
        return ended

    async def _adopt_shared(self) -> None:
        """Cluster mode: the E2B sandboxes other replicas made, a bounded piece of the store
        per sweep, so their timeouts are kept here too (whichever replica's end claim wins
        kills one, once) and hold when the replica that made them is gone."""
        if not self._clustered:
            return
        self._cursor, records = await self.service.persistence.scan(self._cursor)
        for kept in records:
            if kept.state == "running" and CONTEXT_LABEL not in kept.labels:
                self._merge(_restored(kept.id, kept.owner, kept.labels))
