"""The session coordinator of a replica in cluster mode: the shared store is the truth, the
session manager's table a cache of it.

- A session not held here is read from the store and attached (`Backend.attach`), owner-checked
  exactly like a missing one.
- Creation reserves a place under the caps in the store first (`admit`), so caps per key and in
  total hold across replicas; the place is given back when the session ends or was never made.
- Every end (delete, expiry, lifetime, loss) is claimed in the store: the one replica whose claim
  succeeds ends it; the tombstone it leaves makes every replica answer 410 with the reason, and
  drop what it cached.
- Each replica's reaper walks the store's running shared sessions, a bounded piece per round,
  and asks each sandbox how long it has been idle (counted by the sandbox for all replicas).
- Every store call is awaited with the store's short timeout (redis.asyncio): a hung Redis makes
  store calls fail (503), never /healthz or the loop wait; a call on a cached session goes on
  when only its tombstone check fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from code_interpreter_wire.errors import SandboxError, SandboxLost
from orchestrator.cluster.coordination_store import CoordinationStore
from orchestrator.cluster.shared import SharedSandbox
from orchestrator.metrics import METRICS
from orchestrator.sessions import (
    Session,
    SessionBusy,
    SessionError,
    SessionExpired,
    SessionLimitReached,
    SessionLost,
    SessionManager,
    SessionNotFound,
)
from orchestrator.settings_sections import ClusterSection, saved_states_path
from orchestrator.state_store.records import SessionRecord
from orchestrator.state_store.redis_connection import CorruptRecord, StoreUnavailable
from sandbox.backends.base import Sandbox

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)
LOST = "lost: "  # how a tombstone of a lost session begins
_ABANDONED_AFTER_S = 600.0  # a place reserved this long with no record: its replica died
# How often a replica looks for session actors and paused machines no record names: at most
# this, and often enough to see one twice `cluster_orphan_after_s` apart soon after.
_ORPHAN_SWEEP_S = 60.0
_PROBE_TIMEOUT_S = 10.0  # the longest the reaper waits for one sandbox to say its activity

OnAttach = Callable[[Session, SessionRecord], Awaitable[None]]
# A shared session found due: True when the service dealt with it (paused it), else it ends.
OnIdle = Callable[[SessionRecord, str], Awaitable[bool]]


def gone(session_id: str, why: str) -> SessionError:
    """The error an ended session answers with: lost, or expired/deleted."""
    if why.startswith(LOST):
        return SessionLost(f"session {session_id} was {why}")
    return SessionExpired(f"session {session_id} {why}")


class ClusterCoordinator:
    shared_store = True

    def __init__(
        self,
        settings: ClusterSection,
        connection: RedisConnection,
        on_attach: OnAttach | None = None,
        on_idle: OnIdle | None = None,
    ) -> None:
        """`connection`: the Redis every replica shares (closed by the service's persistence).
        `on_attach`: told each session attached from the store (to serve its host tools).
        `on_idle`: asked first about each shared session found due (auto-pause)."""
        from orchestrator.state_store.redis_store import RedisStore  # the [cluster] extra's

        self.settings = settings
        # The session records every replica keeps ...
        saved_states = saved_states_path(settings.saved_states_dir, settings.state_dir)
        self.store = RedisStore(connection, snapshots_dir=saved_states)
        # ... and the caps, claims and tombstones they agree on, in the same Redis.
        self.coordination = CoordinationStore(
            connection,
            tombstone_ttl_s=settings.cluster_tombstone_ttl_s,
            max_lifetime_s=settings.max_lifetime_s,
        )
        self._on_attach = on_attach
        self._on_idle = on_idle
        self._table: SessionManager | None = None
        self._attaching: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._cursor = 0  # where the reaper's walk over the store goes on from
        self._probes: dict[str, Sandbox] = {}  # sessions the reaper attached, not served here
        # By backend: the sandboxes no record names -> when first seen so.
        self._unnamed: dict[str, dict[str, float]] = {}
        self._orphan_sweep_s = min(_ORPHAN_SWEEP_S, settings.cluster_orphan_after_s / 4)
        self._next_orphan_sweep = time.monotonic() + self._orphan_sweep_s

    def bind(self, table: SessionManager) -> None:
        self._table = table

    @property
    def table(self) -> SessionManager:
        assert self._table is not None, "bind() first"
        return self._table

    async def closing(self) -> None:
        """Shared sessions belong to the cluster, not to this replica: they are left running
        (another replica serves them); only what lives in this process ends."""
        for session in self.table.all():
            if self._shared(session):
                self._drop(session.id)
        self._probes.clear()

    async def close(self) -> None:
        """Nothing of its own to let go of: the connection is the service's persistence's."""

    # --- creating, under the caps every replica shares
    async def admit(self, owner: str, session_id: str) -> None:
        s = self.settings
        why = await self.coordination.admit(
            owner, session_id, s.max_sessions_per_key, s.max_sessions_total
        )
        if why is not None:
            raise SessionLimitReached(why)

    async def not_made(self, session_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):  # else the abandoned-slot sweep does
            await self.coordination.release(session_id)

    async def released(self, session_id: str) -> None:
        """A session paused (a backend of one machine): its place under the caps is given
        back until it resumes (admitted again then)."""
        await self.coordination.release(session_id)

    async def held_by(self, owner: str) -> int:
        """Every replica's, as the store counts them."""
        return await self.coordination.slots_held(owner)

    # --- finding, in the cache or the store
    async def find(self, session_id: str, owner: str) -> Session | None:
        table = self.table
        record: SessionRecord | None = None
        try:
            ended, raw = await self.coordination.ended_with(
                session_id, self.store.session_key(session_id)
            )
            with contextlib.suppress(CorruptRecord):  # then as if unread: said where it is used
                record = self.store.session_record(raw, session_id)
        except StoreUnavailable as exc:
            if table.live(session_id) is None:
                raise
            # Served from the cache: an end elsewhere still shows (its sandbox is closed).
            log.warning("session %s served unchecked: %s", session_id, exc)
            ended = None
        if ended is not None:
            await self._let_go(session_id)
            if ended[0] == owner:
                raise gone(session_id, ended[1])
            raise SessionNotFound(f"no session {session_id}")
        session = table.live(session_id)
        if session is not None and record is not None and self.stale(session, record):
            # Paused, or resumed on another node, through another replica: this copy is stale.
            self._drop(session_id)
            session = None
        if session is None and session_id.startswith("s-"):
            session = await self._attach(session_id, owner)
        if session is None or not self._shared(session):
            return None  # the table's own answer (a backend of one machine, or none)
        if session.owner != owner:
            raise SessionNotFound(f"no session {session_id}")
        why = self._lifetime_over(session.created_at)
        if why is not None:
            await self.end_elsewhere(session_id, why)
            raise gone(session_id, why)
        return session

    async def _attach(self, session_id: str, owner: str) -> Session | None:
        """The shared session of that id and owner, attached from its record; None when the
        store has none such (the caller then answers as for a missing session)."""
        lock = self._attaching.get(session_id)
        if lock is None:
            lock = self._attaching[session_id] = asyncio.Lock()
        async with lock:
            cached = self.table.live(session_id)
            if cached is not None:
                return cached
            record = await self.store.get_session(session_id)
            if (
                record is None
                or record.owner != owner
                or record.state != "running"
                or record.sandbox_handle is None
                or record.backend not in self.table.backends
            ):
                return None
            sandbox = self._probes.pop(session_id, None)
            if sandbox is not None and sandbox.handle != record.sandbox_handle:
                sandbox = None  # an earlier actor's (paused and resumed meanwhile)
            try:
                if sandbox is None:
                    sandbox = await self.table.backends[record.backend].attach(
                        record.sandbox_handle, record.spec
                    )
            except SandboxLost as exc:
                raise await self.lost(
                    session_id, owner, exc, handle=record.sandbox_handle
                ) from None
            session = _session_of(record, sandbox)
            self.table.hold(session)
        if self._on_attach is not None:
            await self._on_attach(session, record)
        return session

    # --- ending, once across replicas
    async def ended_here(self, session_id: str, owner: str, why: str) -> None:
        """A session of a backend of one machine ended (its sandbox closed first)."""
        try:
            await self.coordination.end(session_id, owner, why)
        except StoreUnavailable as exc:
            log.warning("the end of %s is not in the shared store: %s", session_id, exc)

    async def end_elsewhere(self, session_id: str, why: str) -> None:
        session = self.table.live(session_id)
        owner = session.owner if session is not None else None
        if owner is None:
            record = await self.store.get_session(session_id)
            owner = record.owner if record is not None else None
        if owner is None:
            return
        await self._finish(session_id, owner, why)

    async def _finish(self, session_id: str, owner: str, why: str) -> tuple[bool, str]:
        """End a shared session: the store's end (claim, tombstone, place given back, in one
        step) says whether this replica won it and why it ended; either way its sandbox is
        closed (harmless if closed already: a winner that died before closing it leaves
        nothing running), it is dropped here and its record forgotten. Returns (won, why).

        With the store down the sandbox is closed all the same (a delete is done; a session
        whose record could not be written leaves nothing running), then StoreUnavailable."""
        failed: StoreUnavailable | None = None
        try:
            won, why = await self.coordination.end(session_id, owner, why)
        except StoreUnavailable as exc:
            won, failed = False, exc
        sandbox = None  # the one its record names (a stale copy here is an earlier one's)
        with contextlib.suppress(SandboxError, SessionError):
            sandbox = await self._probe(session_id)
        if sandbox is None and failed is not None:  # the store is down: what is held here
            sandbox = self._cached_sandbox(session_id)
        if sandbox is not None:
            try:
                await sandbox.close()
            except SandboxLost:
                pass  # closing a lost sandbox is done already: nothing to tell
            except SandboxError as exc:
                if won:
                    log.warning("closing the sandbox of %s failed: %s", session_id, exc)
        if won:
            log.info("session %s %s", session_id, why)
        self._drop(session_id)
        self.table.remember_ended(session_id, owner, why)
        try:
            await self.table.told_ended(session_id)
        except StoreUnavailable as exc:
            failed = failed or exc
        if failed is not None:
            raise failed
        return won, why

    async def _let_go(self, session_id: str) -> None:
        """Forget a session another replica ended, with what this one kept for it."""
        held = self.table.live(session_id) is not None
        self._drop(session_id)
        if held:
            await self.table.told_ended(session_id)

    async def lost(
        self, session_id: str, owner: str, exc: SandboxLost, *, handle: str | None = None
    ) -> Exception:
        """Its sandbox (`handle`: the one that failed, where known) is gone: the session ends
        (claimed), and says so from now on; unless its record says a replica paused it, or
        resumed it in another sandbox, meanwhile (the old one was closed on purpose): then only
        this replica's copies of the old one go, and the call is told to come again."""
        if handle is None:
            held = self._cached_sandbox(session_id)
            handle = held.handle if held is not None else None
        try:
            record = await self.store.get_session(session_id)
        except (StoreUnavailable, CorruptRecord):
            record = None  # then as any loss (whose end needs the store too)
        if record is not None and (
            record.state != "running"
            or (handle is not None and record.sandbox_handle not in (None, handle))
        ):
            self._drop_if(session_id, handle)
            return SessionBusy(
                f"session {session_id} was paused or moved through another replica during "
                "this call; call again"
            )
        won, why = await self._finish(session_id, owner, f"{LOST}{exc}")
        if won:
            METRICS.sessions_lost.inc()
        return gone(session_id, why)

    def _drop(self, session_id: str) -> None:
        """Forget a session here without ending it (another replica did, or will serve it)."""
        self.table.drop(session_id)
        self._probes.pop(session_id, None)

    def _drop_if(self, session_id: str, handle: str | None) -> None:
        """Forget the copies here of a session's sandbox `handle` (all, if None); a copy of
        another (its new one) stays."""
        held = self.table.live(session_id)
        if held is not None and held.changing == 0 and handle in (None, held.sandbox.handle):
            self.table.drop(session_id)
        probe = self._probes.get(session_id)
        if probe is not None and handle in (None, probe.handle):
            del self._probes[session_id]

    def stale(self, session: Session, record: SessionRecord) -> bool:
        """Whether this replica's copy of a shared session no longer is the one its record
        names (paused, or running in another sandbox through another replica); never while a
        pause or resume of it is under way here (its record is written last)."""
        if not self._shared(session) or session.changing:
            return False
        return record.names_another_than(session.sandbox.handle)

    def _cached_sandbox(self, session_id: str) -> Sandbox | None:
        session = self.table.live(session_id)
        return session.sandbox if session is not None else self._probes.get(session_id)

    async def _probe(self, session_id: str, record: SessionRecord | None = None) -> Sandbox | None:
        """The sandbox of a shared session its record names (`record`, or read), the copy held
        here if it is that one (for its reaper, its end), or None when it has no record.
        SandboxLost when its actor is gone."""
        found = self._cached_sandbox(session_id)
        if record is None or (found is not None and found.handle != record.sandbox_handle):
            record = await self.store.get_session(session_id)  # a reaper's batch may be old
        if found is not None and (record is None or found.handle == record.sandbox_handle):
            return found
        self._drop_if(session_id, found.handle if found is not None else None)
        backends = self.table.backends
        if record is None or record.sandbox_handle is None or record.backend not in backends:
            return None
        sandbox = await backends[record.backend].attach(record.sandbox_handle, record.spec)
        self._probes[session_id] = sandbox
        return sandbox

    # --- expiry: any replica's reaper may find a session due; one ends it
    def _shared(self, session: Session) -> bool:
        return self.table.shared(session.backend)

    def _lifetime_over(self, created_at: float) -> str | None:
        limit = self.settings.max_lifetime_s
        if time.time() - created_at > limit:
            return f"expired: it reached the maximum lifetime of {limit:g} s"
        return None

    async def reap(self) -> int:
        """The shared sessions' round (those living in this process are the table's own)."""
        ended = await self._reap_shared()
        held = [x.id for x in self.table.all() if self._shared(x)] + list(self._probes)
        for session_id in await self.coordination.ended_among(held):  # ended elsewhere
            await self._let_go(session_id)
        for session_id in await self.coordination.abandoned_slots(_ABANDONED_AFTER_S, 100):
            log.warning("gave back the place of session %s, never recorded", session_id)
            await self.coordination.release(session_id)
        await self._count_nodes()
        await self._sweep_orphans()
        return ended

    async def _sweep_orphans(self) -> None:
        """End the session actors and paused machines no record names for
        `cluster_orphan_after_s` (a replica died between making one and recording it, or
        between storing a machine's image and recording the pause): the backend lists them,
        the store knows which are sessions'. Seen twice that far apart, so a creation or a
        pause under way is never taken for one."""
        now = time.monotonic()
        if now < self._next_orphan_sweep:
            return
        self._next_orphan_sweep = now + self._orphan_sweep_s
        for name, backend in self.table.backends.items():
            list_sandboxes = getattr(backend, "list_sandboxes", None)
            if not backend.capabilities.shared_across_nodes or list_sandboxes is None:
                continue
            live: list[str] = await list_sandboxes()
            # Each live handle asked about (never a listing that may stop at its cap).
            unnamed = set(live) - await self.store.handles_named(live)
            seen = {h: t for h, t in self._unnamed.get(name, {}).items() if h in unnamed}
            self._unnamed[name] = seen
            due = {
                handle
                for handle in unnamed
                if now - seen.setdefault(handle, now) >= self.settings.cluster_orphan_after_s
            }
            if due:
                # A paused machine is its session's while a record names the sandbox it was
                # paused from (its pause's record may not have been written); and the records
                # themselves are read before anything ends: the set may lag them.
                paused_from = getattr(backend, "paused_from", None)
                aliases: dict[str, str] = await paused_from(due) if paused_from else {}
                named = await self.store.handles_in_records(due | set(aliases.values()))
                due = {h for h in due if h not in named and aliases.get(h) not in named}
            for handle in sorted(due):
                try:  # one sandbox's trouble is its own: the sweep goes on with the next
                    await backend.discard(handle)
                except (SandboxError, OSError) as exc:  # BackendUnavailable is a SandboxError
                    log.warning("could not end sandbox %s no session names: %s", handle, exc)
                    continue
                log.warning(
                    "ended sandbox %s (a session actor or a paused machine): no session names it",
                    handle,
                )
                del seen[handle]

    async def _reap_shared(self) -> int:
        """One bounded step of the walk over the store's running shared sessions."""
        self._cursor, records = await self.store.scan_sessions(
            self._cursor, self.settings.cluster_reap_batch
        )
        ended = 0
        for record in records:
            if not self.table.shared(record.backend) or record.state != "running":
                continue
            try:  # one sandbox's trouble is its own: the round goes on with the next
                ended += await self._reap_one(record)
            except (SandboxError, SessionError, TimeoutError) as exc:
                log.warning("the reaper skipped session %s: %r", record.id, exc)
        return ended

    async def _reap_one(self, record: SessionRecord) -> int:
        """End one running shared session if due or lost; 1 if this replica ended it."""
        why = self._lifetime_over(record.created_at)
        idle = False
        if why is None:
            try:
                why = await asyncio.wait_for(self._idle_expiry(record), _PROBE_TIMEOUT_S)
            except SandboxLost as exc:  # its actor is gone (seen by this reaper or not)
                await self.lost(record.id, record.owner, exc, handle=record.sandbox_handle)
                return 0
            idle = True
        if why is None:
            return 0
        if idle and self._on_idle is not None and await self._on_idle(record, why):
            return 0  # paused (or used again meanwhile): not ended
        won, _ = await self._finish(record.id, record.owner, why)
        if won:  # counted once across replicas
            METRICS.sessions_expired.inc()
        return 1 if won else 0

    async def _idle_expiry(self, record: SessionRecord) -> str | None:
        sandbox = await self._probe(record.id, record)
        if not isinstance(sandbox, SharedSandbox):
            return None
        idle_s, in_flight = await sandbox.activity()
        timeout = record.idle_timeout_s or self.settings.idle_timeout_s
        if in_flight == 0 and idle_s > timeout:
            return f"expired after {timeout:g} s without activity"
        return None

    async def _count_nodes(self) -> None:
        """Sessions, capacity and liveness of each node, on /metrics."""
        for backend in self.table.backends.values():
            nodes_of = getattr(backend, "nodes", None)
            if nodes_of is None:
                continue
            try:
                found = nodes_of()
                nodes = await found if inspect.isawaitable(found) else found
            except SandboxError as exc:
                log.warning("the cluster's nodes are unknown: %s", exc)
                continue
            for gauge in (METRICS.node_sessions, METRICS.node_capacity, METRICS.node_alive):
                gauge.clear()  # nodes gone from the cluster leave no stale series
            for node in nodes:
                METRICS.node_sessions.labels(node.node_id).set(node.sessions)
                METRICS.node_capacity.labels(node.node_id).set(node.capacity)
                METRICS.node_alive.labels(node.node_id).set(1 if node.alive else 0)


def _session_of(record: SessionRecord, sandbox: Sandbox) -> Session:
    """The session a record describes, as another replica made it."""
    session = Session(
        id=record.id,
        owner=record.owner,
        backend=record.backend,
        sandbox=sandbox,
        created_at=record.created_at,
        executions=record.executions,
        idle_timeout_s=record.idle_timeout_s,
        on_idle=record.on_idle,
        labels=dict(record.labels),
        ports=record.ports,
    )
    # Its age counts from its creation, wherever that was.
    session.started_monotonic = time.monotonic() - max(0.0, time.time() - record.created_at)
    return session
