"""Inbound ports (docs/ports.md): the servers a session's code starts, reached from outside.

Decided here, once, for every front that carries such traffic (the path form under /v1, the
`<port>-<id>.<domain>` hosts, E2B's `get_host`): whether a session may have ports at all, who
may open a connection to one (its owner's key, its port token, or anyone where it is public),
how many connections are open at once, how many bytes each may carry, and what the audit log
keeps of each. The bytes travel through a relay process in the sandbox (sandbox/port_relay.py);
the fronts speak HTTP and WebSocket over the stream this hands them.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from code_interpreter_wire.errors import PortUnreachable, SandboxError
from code_interpreter_wire.ports import PortAccess, PortsInfo, PortsRequest
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.session_error import SessionError
from orchestrator.sessions import Session, SessionManager
from orchestrator.settings_sections import PortsSection
from orchestrator.state_store import SessionRecord
from sandbox.port_relay import PortStream, open_port


class PortsNotAllowed(SessionError):
    """Ports asked for where the operator or the backend gives none (or not public ones)."""

    status = 403


class PortsNotOpen(SessionError):
    """The session exists but did not ask for ports: nothing of it is served from outside."""

    status = 403

    @classmethod
    def of(cls, session_id: str) -> PortsNotOpen:
        return cls(
            f"session {session_id} was created without ports: nothing in it is served from "
            "outside; create a session with `ports` (an object, {} for the default)"
        )


class PortAccessDenied(SessionError):
    """A request to a session's port without its owner's key or its port token."""

    status = 401


class PortsBusy(SessionError):
    """A cap on open connections to ports is reached (the message names which)."""

    status = 503


class NoSuchPortRoute(SessionError):
    """No running session by that id (or not one whose ports this caller may know of)."""

    status = 404


def ports_info(session_id: str, access: PortAccess | None, domain: str | None) -> PortsInfo | None:
    """How a session's owner reaches its ports (`domain`: the operator's ports_domain)."""
    if access is None:
        return None
    return PortsInfo(
        public=access.public,
        token=access.token,
        path=f"/v1/sessions/{session_id}/ports/{{port}}/",
        host=f"{{port}}-{session_id}.{domain}" if domain else None,
    )


@dataclass(frozen=True)
class PortCaller:
    """Who asks to open a connection: the owner a key proved (None: no key, or not one of this
    service's), the port token sent (None: none), and the client's address (for the log)."""

    owner: str | None
    token: str | None
    client: str | None


@dataclass(eq=False)  # each one is itself: kept in sets, by identity
class PortConnection:
    """One open connection to a session's port: the relay's stream, counted and capped. Closed
    once, by its front or when its session ends; the audit log then has it."""

    session: Session
    port: int
    caller: str
    client: str | None
    _stream: PortStream
    _ports: Ports
    _most_bytes: int
    bytes_in: int = 0  # into the sandbox
    bytes_out: int = 0  # out of it
    started: float = field(default_factory=time.monotonic)
    closed: bool = False
    ended_why: str = "closed"

    async def read(self, max_bytes: int) -> bytes:
        """Bytes from the server (b"": it closed, or the connection is over its byte cap)."""
        if self.closed:
            return b""
        data = await self._stream.read(max_bytes)
        self.bytes_out += len(data)
        self.session.touch()
        if self.bytes_in + self.bytes_out > self._most_bytes:
            await self.close(f"over the cap of {self._most_bytes} bytes a connection may carry")
            return b""
        return data

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError(f"the connection to port {self.port} is closed")
        if self.bytes_in + self.bytes_out + len(data) > self._most_bytes:
            await self.close(f"over the cap of {self._most_bytes} bytes a connection may carry")
            raise ConnectionResetError(
                f"the connection to port {self.port} carried its most bytes "
                f"({self._most_bytes}, ports_max_bytes_per_connection)"
            )
        self.bytes_in += len(data)
        self.session.touch()
        await self._stream.write(data)

    async def write_eof(self) -> None:
        await self._stream.write_eof()

    async def close(self, why: str = "closed") -> None:
        """Its slot is free and the log has it at once; then the relay is ended (within a
        bound: a sandbox holding its relay cannot hold the slot)."""
        if self.closed:
            return
        self.closed = True
        self.ended_why = why
        self._ports.closed(self)
        await self._stream.close()


class Ports:
    """Sessions' inbound ports: access, caps, and the connections open now."""

    def __init__(
        self,
        settings: PortsSection,
        sessions: SessionManager,
        trail: AuditTrail,
        *,
        wake: Callable[[str, str], Awaitable[Session]],
        state: Callable[[str, str], Awaitable[Session | SessionRecord | None]],
    ) -> None:
        """`wake`: the owner's session by id, resumed if it was paused (Lifecycle.get);
        `state`: the same, not woken (Lifecycle.state)."""
        self.settings = settings
        self._sessions = sessions
        self._trail = trail
        self._wake = wake
        self._state = state
        self._open: dict[str, set[PortConnection]] = {}  # by session id
        self._held: dict[str, int] = {}  # slots held (open or opening), by session id
        self._count = 0
        self._audit_rate = RateLimitItemPerMinute(settings.ports_audited_per_minute)
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        # Connections the rate left out of the log, with their session, by session id.
        self._unaudited: dict[str, tuple[Session, int]] = {}

    # --- at a session's creation
    def access_for(
        self,
        backend: str,
        asked: PortsRequest | None,
        *,
        if_offered: bool = False,
        token: str | None = None,
    ) -> PortAccess | None:
        """The ports a new session on `backend` gets for what it asked (None: none), refused
        (PortsNotAllowed, saying why) where the operator or the backend gives none; with
        `if_offered` (a front whose sessions have ports unless they cannot: E2B's), None there
        instead. Public ports the operator forbids are refused either way."""
        if asked is None:
            return None
        if not self.settings.ports_enabled:
            if if_offered:
                return None
            raise PortsNotAllowed(
                "inbound ports are off on this service (ports_enabled); create the session "
                "without `ports`, or ask the operator to turn them on"
            )
        if not self._sessions.backends[backend].capabilities.ports:
            if if_offered:
                return None
            raise PortsNotAllowed(
                f"the {backend} backend cannot serve its sandboxes' ports; use the local, "
                "docker or gvisor backend"
            )
        if asked.public and not self.settings.ports_public:
            raise PortsNotAllowed(
                "public ports are off on this service (ports_public): ask for ports without "
                "`public`, and reach them with the session's port token or your key"
            )
        return PortAccess(
            public=asked.public,
            token=token or secrets.token_urlsafe(24),
            host_header=asked.host_header,
        )

    @property
    def public_by_default(self) -> bool:
        """Whether a front whose sessions are public unless they say (E2B's) makes them so."""
        return self.settings.ports_public

    # --- connections
    async def session_for(self, session_id: str, caller: PortCaller) -> Session | None:
        """The running session whose ports `caller` asks for; its owner's key wakes a paused
        one (a token or a public port does not: nothing of a paused session listens)."""
        live = self._sessions.live(session_id)
        if live is not None or caller.owner is None:
            return live
        try:
            found = await self._state(session_id, caller.owner)
            if found is None:
                return None
            if found.ports is None:  # not woken for what it will refuse
                raise PortsNotOpen.of(session_id)
            return await self._wake(session_id, caller.owner)
        except PortsNotOpen:
            raise
        except SessionError:  # not found, not the caller's, expired: told as unknown
            return None

    def check(self, session: Session | None, caller: PortCaller) -> str:
        """How `caller` may reach `session`'s ports ("owner", "token" or "public"), or the
        refusal. Another key's session, or one that asked for no ports, is as unknown to a
        caller without its key as a missing one."""
        is_owner = session is not None and caller.owner == session.owner
        if session is None or (session.ports is None and not is_owner):
            raise NoSuchPortRoute(
                "no running session by that id serves ports (ended, never made, or not "
                "yours); a paused one is woken by its owner's key"
            )
        access = session.ports
        if access is None:
            raise PortsNotOpen.of(session.id)
        if is_owner:
            return "owner"
        if caller.token is not None and hmac.compare_digest(
            caller.token.encode(), access.token.encode()
        ):
            return "token"
        if access.public:
            return "public"
        if caller.token is not None:
            raise PortAccessDenied(
                "that is not this session's port token; its owner finds the token in the "
                "session's info (ports.token)"
            )
        raise PortAccessDenied(
            "this session's ports are not public: send its owner's API key as X-API-Key (an "
            "Authorization header goes on to the server in the sandbox) or its port token as "
            "X-Port-Token"
        )

    async def connect(self, session: Session, port: int, caller: PortCaller) -> PortConnection:
        """A connection to `port` in `session`'s sandbox for `caller` (as `check` allows),
        within the caps; PortUnreachable when nothing listens there (logged, as refusals are)."""
        kind = self.check(session, caller)
        started = time.monotonic()
        try:
            self._hold_slot(session)
        except PortsBusy as busy:
            self._refused(session, port, kind, caller, started, str(busy))
            raise
        try:
            async with session.reach():
                stream = await open_port(session.sandbox.shared_spawner(), port)
        except BaseException as exc:
            self._release_slot(session.id)
            if isinstance(exc, SandboxError | PortUnreachable):
                self._refused(session, port, kind, caller, started, str(exc))
            raise
        connection = PortConnection(
            session,
            port,
            kind,
            caller.client,
            stream,
            self,
            self.settings.ports_max_bytes_per_connection,
        )
        self._open.setdefault(session.id, set()).add(connection)
        return connection

    def _hold_slot(self, session: Session) -> None:
        """A slot for a connection about to be opened: counted at once (before the relay
        starts), so requests at the same moment cannot pass the caps together."""
        s = self.settings
        held = self._held.get(session.id, 0)
        if held >= s.ports_max_connections_per_session:
            raise PortsBusy(
                f"session {session.id} has {held} connections to its ports open, its cap "
                "(ports_max_connections_per_session); close some and retry"
            )
        if self._count >= s.ports_max_connections_total:
            raise PortsBusy(
                f"the service holds {self._count} connections to sessions' ports, its cap "
                "(ports_max_connections_total) shared by every session; retry later"
            )
        self._count += 1
        self._held[session.id] = held + 1

    def _release_slot(self, session_id: str) -> None:
        self._count -= 1
        left = self._held.get(session_id, 0) - 1
        if left > 0:
            self._held[session_id] = left
        else:
            self._held.pop(session_id, None)

    def closed(self, connection: PortConnection) -> None:
        """Told by a connection as it closes: its slot is free, the log has it."""
        held = self._open.get(connection.session.id)
        if held is not None:
            held.discard(connection)
            if not held:
                del self._open[connection.session.id]
        self._release_slot(connection.session.id)
        self._audit(
            connection.session,
            port=connection.port,
            caller=connection.caller,
            client=connection.client,
            status="closed",
            duration_s=time.monotonic() - connection.started,
            bytes_in=connection.bytes_in,
            bytes_out=connection.bytes_out,
            reason=connection.ended_why,
        )

    def _refused(
        self,
        session: Session,
        port: int,
        kind: str,
        caller: PortCaller,
        started: float,
        reason: str,
    ) -> None:
        self._audit(
            session,
            port=port,
            caller=kind,
            client=caller.client,
            status="refused",
            duration_s=time.monotonic() - started,
            bytes_in=0,
            bytes_out=0,
            reason=reason,
        )

    def _audit(self, session: Session, *, caller: str, **event: Any) -> None:
        """The audit event of a connection: every one of its owner's; others' (a public
        port's anyone, a token's holder) at most `ports_audited_per_minute` a session, the
        rest counted into the next event, so no one can flood the log through a port."""
        if caller != "owner" and not self._limiter.hit(self._audit_rate, session.id):
            _, count = self._unaudited.get(session.id, (session, 0))
            self._unaudited[session.id] = (session, count + 1)
            return
        _, left_out = self._unaudited.pop(session.id, (session, 0))
        self._trail.port_connection(session, caller=caller, unaudited_before=left_out, **event)

    def open_count(self, session_id: str) -> int:
        return len(self._open.get(session_id, ()))

    async def ended(self, session_id: str) -> None:
        """Its session ended: every connection to it is closed (its relays are gone too), and
        the connections the rate left out of the log are counted there."""
        connections = list(self._open.get(session_id, ()))
        for connection in connections:
            with contextlib.suppress(Exception):
                await connection.close("its session ended")
        session, left_out = self._unaudited.pop(session_id, (None, 0))
        self._limiter.clear(self._audit_rate, session_id)
        if session is not None and left_out:
            self._trail.port_connection(
                session,
                port=0,
                caller="public",
                client=None,
                status="unaudited",
                duration_s=0.0,
                bytes_in=0,
                bytes_out=0,
                reason=f"{left_out} connections past the rate of ports_audited_per_minute",
                unaudited_before=left_out,
            )
