"""E2B sandboxes are our sessions: what E2B adds to a session is kept here.

An E2B sandbox's id is its session's id. E2B adds an access token (checked on every data-plane
call, so one key's sandbox cannot be reached with another's), a template name, metadata, a
deadline (E2B's `timeout`: the sandbox is killed that long after creation or the last
`set_timeout`, whatever its activity; until then the idle expiry does not end it), and the code
contexts made beside the default one, each a session of its own (see contexts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from orchestrator.auth import LOCAL_OWNER
from orchestrator.schemas import CreateSessionRequest
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError, SessionNotFound
from sandbox.languages import PYTHON

log = logging.getLogger(__name__)

# The id the SDK uses for every sandbox when E2B_DEBUG is set (it then skips the control plane
# and sends no credentials): served only by a service whose auth is disabled.
DEBUG_SANDBOX_ID = "debug_sandbox_id"
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout
# E2B's home, every context's working directory unless one is asked for; in our sandboxes it is
# a link to the workspace, so files there and in the workspace are the same files.
E2B_HOME = "/home/user"
# The id E2B's server also answers to for the default Python context.
DEFAULT_CONTEXT = "default"
_CONTEXT_IDS = uuid.UUID("9a4c1f0e-5b7d-4f43-8d8e-2f6a1c3b7e51")


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

    def set_timeout(self, timeout_s: float) -> None:
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


class E2BSandboxes:
    """The E2B view of the service's sessions, and the clock of E2B's timeouts."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._records: dict[str, E2BRecord] = {}  # by sandbox id
        self._context_sessions: set[str] = set()
        self._debug_lock = asyncio.Lock()

    # ----------------------------------------------------------------------------------------

    def add(self, session: Session, *, template: str, metadata: dict[str, str]) -> E2BRecord:
        record = E2BRecord(
            sandbox_id=session.id,
            session_id=session.id,
            owner=session.owner,
            token=secrets.token_urlsafe(32),
            template=template,
            metadata=metadata,
            started_at=datetime.fromtimestamp(session.created_at, UTC),
        )
        self._records[session.id] = record
        return record

    def add_context(
        self, record: E2BRecord, session: Session, cwd: str | None, language: str
    ) -> Context:
        context = Context(id=session.id, cwd=cwd, language=language)
        record.contexts[context.id] = context
        self._context_sessions.add(session.id)
        return context

    def is_live(self, record: E2BRecord) -> bool:
        """Whether the sandbox is still tracked (not killed, timed out or forgotten)."""
        return self._records.get(record.sandbox_id) is record

    def is_context(self, session_id: str) -> bool:
        return session_id in self._context_sessions

    async def owned(self, sandbox_id: str, owner: str) -> tuple[E2BRecord, Session]:
        """For the control plane: the caller's sandbox, or SessionNotFound/SessionExpired.

        A session made through /v1 is an E2B sandbox too, once asked for."""
        record = self._records.get(sandbox_id)
        session_id = record.session_id if record else sandbox_id
        if self.is_context(session_id):
            raise SessionNotFound(f"no sandbox {sandbox_id}")
        try:
            session = await self.service.get_session(session_id, owner)
        except SessionError:
            if record is not None and record.owner == owner:
                await self.forget(record)
            raise
        if record is None:
            record = self.add(session, template=session.backend, metadata={})
        return record, session

    async def reachable(self, sandbox_id: str, token: str | None) -> tuple[E2BRecord, Session]:
        """For the data plane: the sandbox this token opens, or SandboxGone."""
        record = self._records.get(sandbox_id)
        if record is None and sandbox_id == DEBUG_SANDBOX_ID:
            record = await self._debug_record()
        if record is None:
            raise SandboxGone(sandbox_id)
        if record.token is not None and not hmac.compare_digest(
            (token or "").encode(), record.token.encode()
        ):
            raise SandboxGone(sandbox_id)  # like a missing one: ids are not confirmed
        try:
            session = await self.service.get_session(record.session_id, record.owner)
        except SessionError:
            await self.forget(record)
            raise SandboxGone(sandbox_id) from None
        return record, session

    async def _debug_record(self) -> E2BRecord | None:
        """The sandbox of E2B_DEBUG clients, made on first use; only when auth is disabled."""
        if not self.service.settings.auth_disabled:
            return None
        async with self._debug_lock:
            record = self._records.get(DEBUG_SANDBOX_ID)
            if record is not None:
                return record
            session = await self.service.create_session(
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

    def listed(self, owner: str) -> list[Session]:
        """The caller's sessions that are sandboxes (not contexts of one)."""
        return [s for s in self.service.list_sessions(owner) if not self.is_context(s.id)]

    async def kill(self, record: E2BRecord) -> None:
        """End the sandbox's session and every context's."""
        await self.forget(record)
        with contextlib.suppress(SessionError):
            await self.service.end_session(record.session_id, record.owner)

    async def forget(self, record: E2BRecord) -> None:
        """Drop the record of an ended sandbox, ending its contexts' sessions."""
        self._records.pop(record.sandbox_id, None)
        for context in list(record.contexts.values()):
            await self.remove_context(record, context)

    async def remove_context(self, record: E2BRecord, context: Context) -> None:
        record.contexts.pop(context.id, None)
        self._context_sessions.discard(context.id)
        with contextlib.suppress(SessionError):
            await self.service.end_session(context.id, record.owner)

    # ----------------------------------------------------------------------------------------
    # E2B's timeouts

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Sweep while the service runs."""
        sweeper = asyncio.ensure_future(self._sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper

    async def sweep(self) -> int:
        """Kill sandboxes past their deadline, keep the others alive; return how many ended."""
        ended = 0
        now = time.time()
        for record in list(self._records.values()):
            try:
                session = await self.service.get_session(record.session_id, record.owner)
            except SessionError:
                await self.forget(record)
                ended += 1
                continue
            if record.deadline is None:
                continue
            if now >= record.deadline:
                log.info("E2B sandbox %s reached its timeout", record.sandbox_id)
                await self.kill(record)
                ended += 1
                continue
            self.service.keepalive(session)  # E2B's timeout, not idleness, ends it
            for context in list(record.contexts.values()):
                with contextlib.suppress(SessionError):
                    context_session = await self.service.get_session(context.id, record.owner)
                    self.service.keepalive(context_session)
        return ended

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.service.settings.reap_interval_s, 5.0))
            try:
                await self.sweep()
            except Exception:
                log.exception("sweeping E2B sandboxes failed")
