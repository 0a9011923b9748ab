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
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from code_interpreter_wire.errors import BackendUnavailable, SandboxLost
from code_interpreter_wire.ports import PortAccess
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from orchestrator.metrics import METRICS
from orchestrator.session_error import SessionError as SessionError
from orchestrator.settings_sections import SessionTableSection
from sandbox import Backend, Sandbox
from sandbox.pool import WarmPool
from sandbox.preload import preload_code
from sandbox.run_to_end import finish_even_if_cancelled

log = logging.getLogger(__name__)
T = TypeVar("T")
_TOMBSTONES = 10_000  # how many ended session ids are remembered, to answer "expired"
CREATION_WAIT_S = 45.0  # how long a closing service waits for the sandboxes being made


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
    ports: PortAccess | None = None  # its inbound ports (service_parts/ports.py), if asked for
    # The names of its key's secrets its egress proxy binds (orchestrator/vault/): never values.
    secrets: list[str] = field(default_factory=list)
    changing: int = 0  # pauses or resumes of it under way here: its record may lag behind
    # What a call that finds its sandbox lost raises instead (set by the manager holding it).
    when_lost: Callable[[SandboxLost], Awaitable[Exception]] | None = field(
        default=None, repr=False
    )

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
        """Marks the session in use: it cannot go idle while this runs. Its sandbox's calls are
        made within this or `reach`: a lost sandbox is told as the manager says, here once."""
        self.busy += 1
        self.touch()
        try:
            yield
        except SandboxLost as exc:
            raise await self._lost(exc) from None
        finally:
            self.busy -= 1
            self.touch()

    @contextlib.asynccontextmanager
    async def reach(self, *, active: bool = True) -> AsyncIterator[None]:
        """A call on its sandbox that does not keep it busy (a signal, a process's info): the
        session is active now (`active=False`: a read that is not use, such as a report, leaves
        its idle clock alone), and a lost sandbox is told as in `activity`."""
        if active:
            self.touch()
        try:
            yield
        except SandboxLost as exc:
            raise await self._lost(exc) from None

    async def reaching(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream` (a process's output, read after the call that opened it), a lost sandbox
        told as in `activity`; a reader that leaves stops it now."""
        try:
            async for item in stream:
                yield item
        except SandboxLost as exc:
            raise await self._lost(exc) from None
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _lost(self, exc: SandboxLost) -> Exception:
        return exc if self.when_lost is None else await self.when_lost(exc)


class SessionCoordinator(Protocol):
    """What the session manager asks beyond this process: whether a session may be made under
    the caps, where an end is told, what a lost sandbox means, what else the reaper walks. The
    manager is given one and never branches on which."""

    shared_store: bool  # the records are every replica's (a listing shows other replicas')

    def bind(self, table: SessionManager) -> None:
        """The manager whose sessions this coordinates (told once, as it is made)."""

    async def admit(self, owner: str, session_id: str) -> None:
        """Reserve a place for a new session under the caps, or SessionLimitReached."""

    async def not_made(self, session_id: str) -> None:
        """The session admitted was not made after all: its place is given back."""

    async def released(self, session_id: str) -> None:
        """A session's sandbox stopped while it is paused: its place is given back."""

    async def find(self, session_id: str, owner: str) -> Session | None:
        """A session this coordinator serves (found elsewhere, or ended elsewhere: then the
        error it answers with); None: the manager's own table answers."""

    async def ended_here(self, session_id: str, owner: str, why: str) -> None:
        """A session held here has ended (its sandbox closed): told where the others look."""

    async def end_elsewhere(self, session_id: str, why: str) -> None:
        """End a session not held here, or one every replica serves."""

    async def lost(
        self, session_id: str, owner: str, exc: SandboxLost, *, handle: str | None = None
    ) -> Exception:
        """A session's sandbox (`handle`, where known) is gone: what the call that found it
        raises."""

    async def held_by(self, owner: str) -> int:
        """How many sessions the owner holds, wherever they run."""

    async def reap(self) -> int:
        """The reaper's round beyond the table's own sessions; how many it ended."""

    async def closing(self) -> None:
        """Before the manager ends its sessions at shutdown (shared ones are left running)."""

    async def close(self) -> None:
        """After it has."""


class SessionManager:
    def __init__(
        self,
        settings: SessionTableSection,
        on_end: Callable[[str], Awaitable[None]] | None = None,
        *,
        make_backend: Callable[[str, SandboxSpec], Backend] | None = None,
        given_backends: Mapping[str, Backend] | None = None,
        on_expiry: Callable[[Session, str], Awaitable[None]] | None = None,
        before_cleanup: Callable[[str, Backend], Awaitable[None]] | None = None,
        on_sweep: Callable[[], Awaitable[None]] | None = None,
        coordinator: SessionCoordinator,
    ) -> None:
        """`coordinator`: what is asked beyond this process (caps, ends, lost sandboxes): one
        machine's (orchestrator/session_coordinator.py), or cluster mode's shared store's
        (orchestrator/cluster/coordinator.py). `make_backend`: makes a backend by its name,
        with the sessions' default spec (the composition root knows each one's configuration);
        `given_backends`: those made already."""
        self.settings = settings
        self._make_backend = make_backend
        self._coordinator = coordinator
        self._coordinator.bind(self)
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
        self._none_creating = asyncio.Event()  # set while no sandbox is being made
        self._none_creating.set()
        self._closing = False  # a sandbox made from now on is closed, not served
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
            if self._make_backend is None:
                raise ValueError(f"no {name!r} backend was given and none can be made here")
            backend = self._make_backend(name, self.default_spec())
            if self._before_cleanup is not None:
                await self._before_cleanup(name, backend)
            removed = await backend.cleanup_orphans()
            if removed:
                log.info("removed %d orphans of the %s backend", removed, name)
            self.backends[name] = backend
            if s.pool_size and backend.capabilities.warm_pool:
                preload = preload_code(list(s.preload_modules), s.preload_code or "")
                pool = WarmPool(backend, self.default_spec(), s.pool_size, preload=preload)
                pool.fill()
                self.pools[name] = pool
        self._reaper = asyncio.ensure_future(self._reap_forever())

    async def close(self) -> None:
        """Close every session and pool: nothing is left running (the sessions every replica
        serves are left to the others, in cluster mode)."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        try:
            await self._coordinator.closing()
            await self._end_all()
            # Sandboxes still being made (a request running on, its client maybe gone) are
            # closed by their makers once made; a woken one is held, and ended here. Past the
            # wait (or if the process ends first), the next start's orphan clean-up finds them.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CREATION_WAIT_S):
                    await self._none_creating.wait()
            await self._end_all()
            for pool in self.pools.values():
                await pool.close()
            for name, backend in self.backends.items():
                if name not in self._given:
                    await backend.close()
        finally:
            await self._coordinator.close()

    async def _end_all(self) -> None:
        await asyncio.gather(
            *(self._end(sid, "the service shut down") for sid in list(self._sessions)),
            return_exceptions=True,
        )

    # ----------------------------------------------------------------------------------------

    @property
    def clustered(self) -> bool:
        """Cluster mode: the sessions here are a cache of a store every replica shares."""
        return self._coordinator.shared_store

    def shared(self, backend: str) -> bool:
        """Whether sessions of `backend` are served by every replica (cluster mode)."""
        found = self.backends.get(backend)
        return found is not None and found.capabilities.shared_across_nodes

    def saves_states(self, backend: str) -> bool:
        """Whether sessions of `backend` can be saved (snapshots, a pause from a saved state):
        its sandboxes can, and, where every replica serves them, the saved states are kept
        where every replica finds them (`saved_states_dir`)."""
        found = self.backends.get(backend)
        if found is None or not found.capabilities.snapshot:
            return False
        return not self.shared(backend) or self.settings.saved_states_dir is not None

    def pauses(self, backend: str) -> bool:
        """Whether sessions of `backend` can be paused (by its engine, or from a saved state).
        Where every replica serves them, only with the shared saved states: what its engine
        pauses waits there too."""
        found = self.backends.get(backend)
        if found is None:
            return False
        engine = found.capabilities.suspend and not self.shared(backend)
        return engine or self.saves_states(backend)

    async def held_by(self, owner: str) -> int:
        """How many sessions the owner holds (in cluster mode: on every replica)."""
        return await self._coordinator.held_by(owner)

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
        fork: Path | None = None,
    ) -> Session:
        """A session with a new sandbox; `session_id`: the id of a paused one it resumes, and
        `wake`: the backend's handle of its suspended sandbox, woken instead of a new one;
        `fork`: a whole-sandbox snapshot its sandbox is restored from (`Backend.fork`)."""
        name = self.enabled_backend(backend)
        if self._closing:
            raise BackendUnavailable("the service is shutting down: try again once it is back")
        session_id = session_id or f"s-{secrets.token_hex(12)}"
        await self._coordinator.admit(owner, session_id)
        try:
            return await self._create(owner, name, session_id, spec, env, wake, fork)
        except BaseException:
            await self._coordinator.not_made(session_id)
            raise

    async def _create(
        self,
        owner: str,
        name: str,
        session_id: str,
        spec: SandboxSpec | None,
        env: dict[str, str] | None,
        wake: str | None,
        fork: Path | None,
    ) -> Session:
        self._creating[owner] = self._creating.get(owner, 0) + 1
        self._none_creating.clear()
        try:
            spec = spec or self.default_spec()
            pool = self.pools.get(name)
            sandbox = None
            if wake is None and fork is None and pool is not None and pool.fits(spec):
                sandbox = pool.take()
            from_pool = sandbox is not None
            if wake is not None:
                sandbox = await self.backends[name].wake(wake, spec)
            elif fork is not None:
                sandbox = await self.backends[name].fork(fork, spec)
            elif sandbox is None:
                sandbox = await self.backends[name].create(spec)
            try:
                if env:
                    await sandbox.set_env(env)
                # Made while the service closed: nobody would end it. (A woken one is held,
                # and ended by the close: closed here, its engine might not keep it paused.)
                if self._closing and wake is None:
                    raise BackendUnavailable("the service shut down while the sandbox was made")
            except BaseException:
                try:
                    await finish_even_if_cancelled(sandbox.close())
                except Exception:  # what made it fail is what the caller is told
                    log.exception("closing a sandbox that was not served failed")
                raise
        finally:
            self._creating[owner] -= 1
            if not any(self._creating.values()):
                self._none_creating.set()
        session = Session(
            id=session_id,
            owner=owner,
            backend=name,
            sandbox=sandbox,
            from_pool=from_pool,
        )
        if not self.pauses(name):  # nothing of it is kept across a pause
            session.on_idle = "end"
        self.hold(session)
        METRICS.sessions_created.labels(name, "pool" if from_pool else "cold").inc()
        return session

    def hold(self, session: Session) -> None:
        """Serve `session` here (made here, or attached from the cluster)."""
        owner = session.owner

        async def lost(exc: SandboxLost) -> Exception:
            return await self._coordinator.lost(
                session.id, owner, exc, handle=session.sandbox.handle
            )

        session.when_lost = lost
        self._sessions[session.id] = session
        METRICS.sessions_active.labels(session.backend).inc()

    def drop(self, session_id: str) -> Session | None:
        """Forget a session here without ending it (another replica did, or will serve it)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            METRICS.sessions_active.labels(session.backend).dec()
        return session

    async def told_ended(self, session_id: str) -> None:
        """Tell the service a session has ended (what it kept for it goes)."""
        if self._on_end is not None:
            await self._on_end(session_id)

    def check_limits(self, owner: str) -> None:
        """SessionLimitReached when the service, or the owner's key, holds its maximum."""
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
        found = await self._coordinator.find(session_id, owner)
        if found is not None:
            return found
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

    async def forgotten(self, session_id: str, owner: str, why: str) -> None:
        """A paused session was deleted (it had no sandbox): it answers "expired" (with why)
        from now on, here and, in cluster mode, through every replica."""
        self.remember_ended(session_id, owner, why)
        await self._coordinator.ended_here(session_id, owner, why)

    def why_ended(self, session_id: str) -> tuple[str, str] | None:
        """(owner, why) of a session that ended here lately (told to the audit log)."""
        return self._ended.get(session_id)

    async def release(self, session: Session) -> None:
        """Stop a session's sandbox but not the session (it is paused: its state is saved).
        It is found running until its sandbox is gone, then not at all. The sandbox given is
        closed even if this table let go of it meanwhile (a cluster's stale copy)."""
        session_id = session.id
        try:
            await session.sandbox.close()
        except Exception:
            log.exception("closing the sandbox of %s failed", session_id)
        finally:
            if self._sessions.get(session_id) is session:
                self.drop(session_id)
        await self._coordinator.released(session_id)

    async def end(self, session_id: str, why: str) -> None:
        """End a session for good, whoever owns it (an expiry, a failed pause)."""
        await self._end(session_id, why)

    async def _end(self, session_id: str, why: str) -> None:
        session = self._sessions.get(session_id)
        if session is None or self.shared(session.backend):  # the coordinator's to end
            await self._coordinator.end_elsewhere(session_id, why)
            return
        self.drop(session_id)
        self.remember_ended(session_id, session.owner, why)
        try:
            await session.sandbox.close()
        except Exception:
            log.exception("closing the sandbox of %s failed", session_id)
        await self.told_ended(session_id)
        # After its sandbox is closed: a store that is down (a shutdown) leaves nothing running.
        await self._coordinator.ended_here(session_id, session.owner, why)

    # ----------------------------------------------------------------------------------------

    def overdue(self, session: Session) -> str | None:
        """Why the session is past its time, or None."""
        return self._expiry(session)

    def _expiry(self, session: Session) -> str | None:
        if self.shared(session.backend):  # the coordinator's walk (its sandbox counts its idle)
            return None
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
        return len(due) + await self._coordinator.reap()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap()
                if self._on_sweep is not None:
                    await self._on_sweep()
            except Exception:
                log.exception("reaping sessions failed")
            METRICS.reaper_rounds.inc()  # done, or failed and said: the reaper is alive

    @property
    def count(self) -> int:
        return len(self._sessions)
