"""Sessions: a sandbox with an owner, a clock and a history of executions.

The manager enforces who may touch a session (its owner's key only), how many each key and the
service may hold, and how long they live: an idle session expires, and so does any session past
the maximum lifetime. An expired id answers "expired" (for a while), never a silent new kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.config import Settings
from orchestrator.metrics import METRICS
from sandbox import Backend, ResourceLimits, Sandbox, SandboxSpec, create_backend
from sandbox.pool import WarmPool

log = logging.getLogger(__name__)
_TOMBSTONES = 10_000  # how many ended session ids are remembered, to answer "expired"


class SessionError(Exception):
    """Base of the session errors; each maps to one HTTP status."""

    status = 400


class SessionNotFound(SessionError):
    status = 404


class SessionExpired(SessionError):
    status = 410


class SessionLost(SessionError):
    """Its sandbox is gone with the machine that held it (cluster mode): nothing of it can be
    recovered; start a new session."""

    status = 410


class SessionLimitReached(SessionError):
    status = 429


class BackendNotEnabled(SessionError):
    status = 400


class SessionBusy(SessionError):
    """The session is running code, or changing state, and cannot do what was asked now."""

    status = 409


@dataclass
class Session:
    id: str
    owner: str  # a digest of the owner's API key, never the key
    backend: str
    sandbox: Sandbox
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    started_monotonic: float = field(default_factory=time.monotonic)
    from_pool: bool = False
    executions: int = 0
    busy: int = 0  # requests in flight that keep the session from being idle
    idle_timeout_s: float | None = None  # its own idle expiry (MCP's); None: the service's
    on_idle: Literal["pause", "end"] = "pause"  # what its idle expiry does
    notice: str | None = None  # said with its next execution (what a resume brought back)
    state_lost: bool = False  # ... and whether that resume lost its variables
    labels: dict[str, str] = field(default_factory=dict)  # a front's own (E2B's metadata)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def idle_for(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self.last_active

    def age(self) -> float:
        return time.monotonic() - self.started_monotonic

    @property
    def limits(self) -> ResourceLimits:
        return self.sandbox.spec.limits

    @property
    def image(self) -> str | None:
        """The kernel image (Docker); None where the backend has none to choose."""
        return self.sandbox.spec.image

    @contextlib.asynccontextmanager
    async def activity(self) -> AsyncIterator[None]:
        """Marks the session in use: it cannot go idle while this runs."""
        self.busy += 1
        self.touch()
        try:
            yield
        finally:
            self.busy -= 1
            self.touch()


class SessionManager:
    def __init__(
        self,
        settings: Settings,
        on_end: Callable[[str], Awaitable[None]] | None = None,
        *,
        given_backends: Mapping[str, Backend] | None = None,
        on_expiry: Callable[[Session, str], Awaitable[None]] | None = None,
        before_cleanup: Callable[[str, Backend], Awaitable[None]] | None = None,
        on_sweep: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self._on_end = on_end  # told each ended session's id (to drop what is kept for it)
        # What an expired session becomes (paused, or ended); None: ended.
        self._on_expiry = on_expiry
        # Told each backend's name before what a crash left of it is cleared (to save files).
        self._before_cleanup = before_cleanup
        self._on_sweep = on_sweep  # called on each of the reaper's rounds (retention)
        # Backends the caller made and closes itself (an embedded session's): used as they are,
        # never swept for orphans (their other sandboxes are not ours) nor closed here.
        self._given = dict(given_backends or {})
        self.backends: dict[str, Backend] = {}
        self.pools: dict[str, WarmPool] = {}
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (owner, why)
        self._creating: dict[str, int] = {}  # owner -> sessions being created
        self._reaper: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------------------------------

    def default_spec(self) -> SandboxSpec:
        s = self.settings
        return SandboxSpec(
            limits=s.default_limits,
            default_timeout_s=s.execution_timeout_s,
            output_limit_chars=s.output_limit_chars,
            network=s.network_default,
        )

    async def start(self) -> None:
        """Make the backends, clear what a crash left, fill the pools, start the reaper."""
        s = self.settings
        for name in s.backends:
            if name in self._given:
                self.backends[name] = self._given[name]
                continue
            config: dict[str, object] = {"state_dir": s.state_dir}
            if name == "docker":
                config |= {"orchestrator_id": s.orchestrator_id, "image": s.docker_image}
                config |= {"runtime": s.docker_runtime}
            if name == "e2b":
                config = s.e2b_backend_config()
            if name == "ray":  # warm actors (per node) are made for the default spec
                config = s.ray_backend_config() | {"pool_spec": self.default_spec()}
            backend = create_backend(name, **config)
            if self._before_cleanup is not None:
                await self._before_cleanup(name, backend)
            removed = await backend.cleanup_orphans()
            if removed:
                log.info("removed %d orphans of the %s backend", removed, name)
            self.backends[name] = backend
            if s.pool_size and backend.keeps_warm:
                pool = WarmPool(backend, self.default_spec(), s.pool_size)
                pool.fill()
                self.pools[name] = pool
        self._reaper = asyncio.ensure_future(self._reap_forever())

    async def close(self) -> None:
        """Close every session and pool: nothing is left running."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(
            *(self._end(sid, "the service shut down") for sid in list(self._sessions)),
            return_exceptions=True,
        )
        for pool in self.pools.values():
            await pool.close()
        for name, backend in self.backends.items():
            if name not in self._given:
                await backend.close()

    # ----------------------------------------------------------------------------------------

    def enabled_backend(self, backend: str | None) -> str:
        """The backend a new session asked for (None: the default), if enabled here."""
        name = backend or self.settings.default_backend
        if name not in self.backends:
            raise BackendNotEnabled(
                f"backend {name!r} is not enabled here; enabled: {', '.join(self.backends)}"
            )
        return name

    async def create(
        self,
        owner: str,
        *,
        backend: str | None = None,
        spec: SandboxSpec | None = None,
        env: dict[str, str] | None = None,
        session_id: str | None = None,
        wake: str | None = None,
    ) -> Session:
        """A session with a new sandbox; `session_id`: the id of a paused one it resumes, and
        `wake`: the backend's handle of its suspended sandbox, woken instead of a new one."""
        name = self.enabled_backend(backend)
        self._check_limits(owner)
        self._creating[owner] = self._creating.get(owner, 0) + 1
        try:
            spec = spec or self.default_spec()
            pool = self.pools.get(name)
            sandbox = None
            if wake is None and pool is not None and pool.fits(spec):
                sandbox = pool.take()
            from_pool = sandbox is not None
            if wake is not None:
                sandbox = await self.backends[name].wake(wake, spec)
            elif sandbox is None:
                sandbox = await self.backends[name].create(spec)
            try:
                if env:
                    await sandbox.set_env(env)
            except BaseException:
                await sandbox.close()
                raise
        finally:
            self._creating[owner] -= 1
        session = Session(
            id=session_id or f"s-{secrets.token_hex(12)}",
            owner=owner,
            backend=name,
            sandbox=sandbox,
            from_pool=from_pool,
        )
        self._sessions[session.id] = session
        METRICS.sessions_created.labels(name, "pool" if from_pool else "cold").inc()
        METRICS.sessions_active.labels(name).inc()
        return session

    def _check_limits(self, owner: str) -> None:
        s = self.settings
        total = len(self._sessions) + sum(self._creating.values())
        if total >= s.max_sessions_total:
            raise SessionLimitReached(
                f"the service holds its maximum of {s.max_sessions_total} sessions; "
                "close one or try again later"
            )
        mine = sum(1 for x in self._sessions.values() if x.owner == owner)
        mine += self._creating.get(owner, 0)
        if mine >= s.max_sessions_per_key:
            raise SessionLimitReached(
                f"this API key holds its maximum of {s.max_sessions_per_key} sessions; "
                "delete one first"
            )

    async def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        if session is not None and session.owner == owner:
            why = self._expiry(session)
            if why is not None and self._would_pause(session):
                return session  # it would be paused, then woken by this very call: keep it
            if why is not None:
                # Found expired before the reaper's turn: end it now and say so.
                await self._end(session_id, why)
                raise SessionExpired(f"session {session_id} {why}")
            return session
        ended = self._ended.get(session_id)
        if ended is not None and ended[0] == owner:
            raise SessionExpired(f"session {session_id} {ended[1]}")
        # Another key's session is reported exactly like a missing one.
        raise SessionNotFound(f"no session {session_id}")

    def _would_pause(self, session: Session) -> bool:
        """Whether its expiry pauses it (else it ends: `idle_action=end` answers 410)."""
        return (
            session.on_idle == "pause"
            and self.settings.idle_action == "pause"
            and self._on_expiry is not None
        )

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def list(self, owner: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.owner == owner]

    async def delete(self, session_id: str, owner: str) -> None:
        await self.get(session_id, owner)
        await self._end(session_id, "was deleted")

    def live(self, session_id: str) -> Session | None:
        """The running session of that id, whoever owns it."""
        return self._sessions.get(session_id)

    def remember_ended(self, session_id: str, owner: str, why: str) -> None:
        """Answer "expired" (with why) for this id from now on."""
        self._ended[session_id] = (owner, why)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def why_ended(self, session_id: str) -> tuple[str, str] | None:
        """(owner, why) of a session that ended here lately (told to the audit log)."""
        return self._ended.get(session_id)

    async def release(self, session_id: str) -> None:
        """Stop a session's sandbox but not the session (it is paused: its state is saved).
        It is found running until its sandbox is gone, then not at all."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        try:
            await session.sandbox.close()
        except Exception:
            log.exception("closing the sandbox of %s failed", session_id)
        finally:
            if self._sessions.get(session_id) is session:
                del self._sessions[session_id]
                METRICS.sessions_active.labels(session.backend).dec()

    async def end(self, session_id: str, why: str) -> None:
        """End a session for good, whoever owns it (an expiry, a failed pause)."""
        await self._end(session_id, why)

    async def _end(self, session_id: str, why: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        self.remember_ended(session_id, session.owner, why)
        METRICS.sessions_active.labels(session.backend).dec()
        try:
            await session.sandbox.close()
        except Exception:
            log.exception("closing the sandbox of %s failed", session_id)
        if self._on_end is not None:
            await self._on_end(session_id)

    # ----------------------------------------------------------------------------------------

    def overdue(self, session: Session) -> str | None:
        """Why the session is past its time, or None."""
        return self._expiry(session)

    def _expiry(self, session: Session) -> str | None:
        s = self.settings
        if session.age() > s.max_lifetime_s:
            return f"expired: it reached the maximum lifetime of {s.max_lifetime_s:g} s"
        idle_timeout_s = session.idle_timeout_s or s.idle_timeout_s
        if session.idle_for() > idle_timeout_s:
            return f"expired after {idle_timeout_s:g} s without activity"
        return None

    async def reap(self) -> int:
        """End every session past its time; return how many."""
        due = [(sid, why) for sid, x in self._sessions.items() if (why := self._expiry(x))]
        for sid, _ in due:
            session = self._sessions.get(sid)
            # Gone, or in use again since (the expiries before it may have taken a while).
            if session is None or session.busy or (why := self._expiry(session)) is None:
                continue
            log.info("session %s %s", sid, why)
            METRICS.sessions_expired.inc()
            if self._on_expiry is not None:
                await self._on_expiry(session, why)
            else:
                await self._end(sid, why)
        return len(due)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap()
                if self._on_sweep is not None:
                    await self._on_sweep()
            except Exception:
                log.exception("reaping sessions failed")

    @property
    def count(self) -> int:
        return len(self._sessions)
