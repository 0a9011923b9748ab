"""The audit log: what ran, who asked and when, kept in the state store (docs/governance.md).

Recording must never hold up or break what it records: `record` is synchronous, does no I/O and
never raises. It caps the event's fields and puts it on a bounded queue; a background task
writes batches to the (async) store. A full queue drops events, counts them, and one
`audit.dropped` event (and a warning) says how many once there is room again. A store that
fails is retried with a pause between tries, the queue still bounded meanwhile. `close()`
flushes what is queued, within a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import shlex
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime
from typing import Any

from orchestrator.governance import audit_kinds
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.policy import Principal
from orchestrator.governance.stores.audit_store import AuditEvent, AuditPage, AuditQuery, AuditStore
from orchestrator.sessions import SessionError
from orchestrator.settings_sections import AuditSection

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.1  # how long an event may wait for others to share its write
MAX_TEXT_CHARS = 2048  # any other text field (a path, a reason, a host)
MAX_LIST_ITEMS = 64
MAX_QUERY_KINDS = 32  # kinds one query may name
MAX_DETAILS = 32  # fields of one event's details
LONG_TEXT_FIELDS = frozenset({"code", "command"})  # capped at `audit_max_code_chars`
MAX_QUEUED_CHARS = 32 << 20  # the text events waiting to be written may hold, in all
_EVENT_CHARS = 256  # what an event costs besides its details' text (its fields, the tuple)
_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # pauses between tries of a failed write; the last repeats
_CLOSE_TIMEOUT_S = 10.0


class BadAuditQuery(SessionError):
    """A filter of an audit query that cannot be read (a time that is no time, a bad kind)."""

    status = 400


def digest(data: bytes | str) -> str:
    """The SHA-256 of what is never kept whole (a tool call's arguments)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def parse_time(text: str) -> float:
    """A time as a query gives it: seconds since the epoch, or ISO 8601 (UTC unless it says)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadAuditQuery(
            f"{text[:64]!r} is not a time: give seconds since the epoch or an ISO 8601 time "
            "(2025-01-31T12:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def parse_kinds(given: list[str] | None) -> list[str] | None:
    """The kinds a query names (each given repeated, or comma-separated); None: every kind.
    A kind no event has is BadAuditQuery listing those there are."""
    kinds = [k.strip() for part in given or [] for k in part.split(",") if k.strip()]
    if len(kinds) > MAX_QUERY_KINDS:
        raise BadAuditQuery(f"at most {MAX_QUERY_KINDS} kinds in one query")
    unknown = [k for k in kinds if k not in audit_kinds.ALL_KINDS]
    if unknown:
        raise BadAuditQuery(
            f"no events are of kind {unknown[0][:64]!r}; the kinds are: "
            + ", ".join(audit_kinds.ALL_KINDS)
        )
    return kinds or None


def command_line(argv: list[str] | None, command: str | None, most: int) -> str:
    """A process's command line as people read it, built no longer than `most` characters
    past its cap (an argv of thousands of long arguments is not joined whole first)."""
    if command is not None or argv is None:
        return (command or "")[: most + 1]
    parts: list[str] = []
    length = 0
    for arg in argv:
        quoted = shlex.quote(arg[: most + 1])
        parts.append(quoted)
        length += len(quoted) + 1
        if length > most:
            break
    return " ".join(parts)


def end_reason(why: str) -> str:
    """A session's end, as a word a filter can use, from the words that say why."""
    for words, reason in (
        (" s paused", "retention"),  # "was deleted after N s paused"
        ("was deleted", "deleted"),
        ("revoked", "revoked"),
        ("maximum lifetime", "lifetime"),
        ("without activity", "idle"),
        ("shut down", "shutdown"),
    ):
        if words in why:
            return reason
    return "lost" if why.startswith("lost") else "other"


def _capped(value: Any, most: int, depth: int = 0) -> tuple[Any, int | None]:
    """`value` within bounds, and the length of the text cut short (None if none was): lists
    and mappings two levels deep at most, each of their items bounded too."""
    if isinstance(value, str):
        return (value[:most], len(value)) if len(value) > most else (value, None)
    if value is None or isinstance(value, bool | int | float):
        return value, None
    if depth >= 2 and isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)}>", None
    if isinstance(value, list | tuple):
        items = itertools.islice(value, MAX_LIST_ITEMS)
        return [_capped(v, MAX_TEXT_CHARS, depth + 1)[0] for v in items], None
    if isinstance(value, dict):
        pairs = itertools.islice(value.items(), MAX_DETAILS)
        return {str(k)[:64]: _capped(v, MAX_TEXT_CHARS, depth + 1)[0] for k, v in pairs}, None
    return _capped(str(value), MAX_TEXT_CHARS)[0], None


def text_size(value: Any) -> int:
    """About how many characters a (capped) value holds: what its place in the queue costs."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + text_size(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(text_size(v) for v in value)
    return 8


def capped_details(details: dict[str, Any] | None, max_code_chars: int) -> dict[str, Any]:
    """An event's details within bounds: code and command lines up to `max_code_chars` (with
    `<field>_truncated` and `<field>_chars` when cut), other text up to MAX_TEXT_CHARS, lists
    up to MAX_LIST_ITEMS, at most MAX_DETAILS fields; anything else as (capped) text."""
    if not details:
        return {}
    kept: dict[str, Any] = {}
    for name, value in itertools.islice(details.items(), MAX_DETAILS):
        most = max_code_chars if name in LONG_TEXT_FIELDS else MAX_TEXT_CHARS
        kept[str(name)[:64]], cut = _capped(value, most)
        if cut is not None:
            kept[f"{name}_truncated"] = True
            kept[f"{name}_chars"] = cut
    return kept


# What `record` queues: (time, kind, owner, session_id, status, duration_s, details, size).
_Pending = tuple[float, str, str, str | None, str | None, float | None, dict[str, Any], int]


class AuditLog:
    def __init__(self, settings: AuditSection, name_of: Callable[[str], str]) -> None:
        """`name_of(owner)`: the principal's name an event carries (asked when it is written,
        on the event loop; an error there gives the owner id's start instead)."""
        self.enabled = settings.audit_enabled
        self._retention_s = settings.audit_retention_s
        self._max_events = settings.audit_max_events
        self._queue_max = settings.audit_queue_max
        self._batch_max = settings.audit_batch_max
        self._max_code_chars = settings.audit_max_code_chars
        self._sweep_every_s = min(3600.0, max(1.0, self._retention_s / 10))
        self._name_of = name_of
        self._queue: deque[_Pending] = deque()
        self._queued_chars = 0  # the queue's size in text (MAX_QUEUED_CHARS at most)
        self._size_lock = threading.Lock()  # egress threads record too
        self.dropped = 0  # in all, since the start
        self._unreported = 0  # dropped since the last audit.dropped event
        self._store: AuditStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._last_sweep = 0.0

    # --- recording
    def record(
        self,
        kind: str,
        *,
        owner: str,
        session_id: str | None = None,
        status: str | None = None,
        duration_s: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        """Queue an event; never waits, never raises (a failure is logged and dropped)."""
        if not self.enabled:
            return
        try:
            if len(self._queue) >= self._queue_max:
                self._drop()
                return
            kept = capped_details(details, self._max_code_chars)
            size = _EVENT_CHARS + text_size(kept)
            with self._size_lock:
                if self._queued_chars + size > MAX_QUEUED_CHARS:
                    fits = False
                else:
                    fits = True
                    self._queued_chars += size
            if not fits:  # long events while the store lags: memory stays bounded
                self._drop()
                return
            self._queue.append(
                (time.time(), kind, owner, session_id, status, duration_s, kept, size)
            )
            if len(self._queue) == 1 or len(self._queue) >= self._batch_max:
                self._poke()
        except Exception:
            log.exception("an audit event (%s) could not be recorded", kind)

    def _drop(self) -> None:
        self.dropped += 1
        self._unreported += 1

    @property
    def queued_chars(self) -> int:
        """About how much text the queued events hold."""
        return self._queued_chars

    def _poke(self) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    @property
    def pending(self) -> int:
        """Events queued, not written yet."""
        return len(self._queue)

    # --- writing
    def start(self, store: AuditStore) -> None:
        """Write to `store` from now on (events recorded before wait for this)."""
        self._store = store
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._writer = asyncio.ensure_future(self._write_forever())
        if self._queue:
            self._wake.set()

    async def close(self) -> None:
        """Write what is queued (within a deadline: what cannot be written then is logged as
        lost), then stop."""
        if self._writer is None:
            return
        self._closing = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._writer), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        finally:
            self._writer = None
        if self._queue:
            log.error("%d audit events could not be written before shutdown", len(self._queue))

    async def _write_forever(self) -> None:
        while not self._closing:
            await self._wake.wait()
            if len(self._queue) < self._batch_max and not self._closing:
                await asyncio.sleep(FLUSH_DELAY_S)  # others may come to share the write
            self._wake.clear()
            try:
                await self._drain()
            except Exception:  # a bug here must not stop the log for good
                log.exception("writing the audit log failed")
        await self._drain()

    async def _drain(self) -> None:
        """Write everything queued, a batch at a time."""
        while self._queue or self._unreported:
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._batch_max))]
            with self._size_lock:
                self._queued_chars -= sum(pending[-1] for pending in batch)
            events = self._events(batch)
            if self._unreported:
                count, self._unreported = self._unreported, 0
                log.warning("the audit queue was full: %d events were dropped", count)
                events.append(self._dropped_event(count))
            if not await self._write(events):
                return

    async def _write(self, events: list[AuditEvent]) -> bool:
        """Write a batch, trying again after a pause while the store fails; False if the
        service is closing and it still could not be written."""
        assert self._store is not None
        attempt = 0
        while True:
            try:
                await self._store.append_events(events)
                return True
            except Exception as exc:
                if self._closing and attempt >= 2:
                    log.error("%d audit events were lost: the store failed: %s", len(events), exc)
                    return False
                if attempt == 0:
                    log.warning("writing %d audit events failed (%s); retrying", len(events), exc)
                await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                attempt += 1

    def _events(self, batch: list[_Pending]) -> list[AuditEvent]:
        names: dict[str, str] = {}
        events = []
        for t, kind, owner, session_id, status, duration_s, details, _ in batch:
            if owner not in names:
                names[owner] = self._name(owner)
            events.append(
                AuditEvent(
                    id=os.urandom(12).hex(),
                    time=t,
                    kind=kind,
                    owner=owner,
                    principal=names[owner],
                    session_id=session_id,
                    status=status,
                    duration_s=duration_s,
                    details=details,
                )
            )
        return events

    def _name(self, owner: str) -> str:
        if owner == audit_kinds.SERVICE_OWNER:
            return audit_kinds.SERVICE_OWNER
        try:
            return self._name_of(owner)
        except Exception:
            log.exception("the name of principal %s is unknown", owner[:12])
            return owner[:12]

    @staticmethod
    def _dropped_event(count: int) -> AuditEvent:
        return AuditEvent(
            id=os.urandom(12).hex(),
            time=time.time(),
            kind=audit_kinds.AUDIT_DROPPED,
            owner=audit_kinds.SERVICE_OWNER,
            principal=audit_kinds.SERVICE_OWNER,
            details={"dropped": count},
        )

    # --- retention
    async def sweep(self, *, now: float | None = None, force: bool = False) -> int:
        """Delete events past the retention (and the oldest past the count kept), at most once
        per `_sweep_every_s` unless forced; how many went. Never raises."""
        if self._store is None:
            return 0
        moment = time.monotonic()
        if not force and moment - self._last_sweep < self._sweep_every_s:
            return 0
        self._last_sweep = moment
        cutoff = (now if now is not None else time.time()) - self._retention_s
        try:
            gone = await self._store.delete_events_before(cutoff)
            gone += await self._store.keep_newest(self._max_events)
        except Exception:
            log.exception("the audit log's retention sweep failed")
            return 0
        if gone:
            log.info("%d audit events past their retention deleted", gone)
        return gone

    # --- reading
    async def query(self, viewer: Principal, query: AuditQuery) -> AuditPage:
        """A page of events `viewer` may see: an admin any key's (`query.principal` names
        one), any other key its own alone."""
        if not viewer.admin:
            if query.principal is not None and query.principal != viewer.name:
                raise PolicyDenied(
                    f"key {viewer.name!r} may not read the audit events of key "
                    f"{query.principal!r}: only an admin key may read other keys' events (rule "
                    "`admin`). Leave out `key` to read your own, or ask an admin"
                )
            query = query.model_copy(update={"owner": viewer.id, "principal": None})
        return await self.page(query)

    async def page(self, query: AuditQuery) -> AuditPage:
        """A page of events, whoever's (the caller decided who may see them)."""
        if self._store is None:
            raise RuntimeError("the audit log is not started")
        return await self._store.query_page(query)

    async def export(
        self, viewer: Principal, query: AuditQuery
    ) -> AsyncGenerator[AuditEvent, None]:
        """Every event `query` selects that `viewer` may see, newest first, a page at a time.
        Access is checked before the first event (so a refusal is an error, not a stream)."""
        first = await self.query(viewer, query)
        return self._pages(viewer, query, first)

    async def _pages(
        self, viewer: Principal, query: AuditQuery, page: AuditPage
    ) -> AsyncGenerator[AuditEvent, None]:
        while True:
            for event in page.events:
                yield event
            if page.next_before is None:
                return
            query = query.model_copy(update={"before_seq": page.next_before})
            page = await self.query(viewer, query)
