"""The audit log in the Redis every replica shares (cluster mode).

Layout, under the store's prefix:
- `audit:doc`, a hash: event id -> the event's JSON (without its seq);
- `audit:seq`, a counter: each event's seq, taken when it is appended (so ids and seqs are
  unique across replicas, and a batch appended again after an unknown outcome is not doubled);
- sorted sets of event ids scored by seq: `audit:all`, and one per owner, principal name,
  session and kind (the filters' indexes); `audit:time`, the ids scored by time (retention).
An append is one Lua script: atomic, whichever replica sends it.

A listing reads the smallest index that fits its filters newest first, a page at a time, and
checks the other filters on each event. Its work is bounded: it stops after looking at
`max_scanned` events, giving fewer than asked for with a cursor to go on from. A `since` filter
stops the walk once events are older than it by `SINCE_SLACK_S` (seqs follow the order events
reached Redis, which may lag their time by a replica's queue and clock: an event appended that
much later than it happened can be missed by a `since` filter, never by a plain listing).

Memory is bounded by the service's retention (`audit_retention_s`) and count
(`audit_max_events`), swept periodically; each event costs its JSON (fields capped when
recorded) plus seven sorted-set entries.
"""

from __future__ import annotations

import logging
from typing import cast

from pydantic import ValidationError

from orchestrator.governance.stores.audit_store import AuditEvent, AuditPage, AuditQuery, AuditStore
from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)

SINCE_SLACK_S = 600.0
_PAGE = 500  # ids read per step of a listing, and removed per step of retention
_FIXED_KEYS = 4  # seq, doc, all, time; then four per event

# KEYS: seq, doc, all, time, then per event: owner, principal, session, kind indexes.
# ARGV per event: id, JSON, time, whether it has a session ("1"/"0"). Returns how many were new.
_APPEND = """
local added = 0
local n = (#KEYS - 4) / 4
for i = 0, n - 1 do
  local id = ARGV[4 * i + 1]
  if redis.call('HSETNX', KEYS[2], id, ARGV[4 * i + 2]) == 1 then
    local seq = redis.call('INCR', KEYS[1])
    redis.call('ZADD', KEYS[3], seq, id)
    redis.call('ZADD', KEYS[4], tonumber(ARGV[4 * i + 3]), id)
    redis.call('ZADD', KEYS[4 + 4 * i + 1], seq, id)
    redis.call('ZADD', KEYS[4 + 4 * i + 2], seq, id)
    if ARGV[4 * i + 4] == '1' then redis.call('ZADD', KEYS[4 + 4 * i + 3], seq, id) end
    redis.call('ZADD', KEYS[4 + 4 * i + 4], seq, id)
    added = added + 1
  end
end
return added
"""


class RedisAudit(AuditStore):
    def __init__(
        self,
        connection: RedisConnection,
        *,
        max_scanned: int = 20_000,
    ) -> None:
        """`connection`: the shared Redis (its client, key prefix and failures).
        `max_scanned`: the most events one listing call looks at."""
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self._max_scanned = max_scanned
        self._append = self._redis.register_script(_APPEND)

    def _index(self, field: str, value: str) -> str:
        return self._key("audit", field, value)

    async def append_events(self, events: list[AuditEvent]) -> None:
        if not events:
            return
        keys = [
            self._key("audit", "seq"),
            self._key("audit", "doc"),
            self._key("audit", "all"),
            self._key("audit", "time"),
        ]
        args: list[str] = []
        for e in events:
            keys += [
                self._index("owner", e.owner),
                self._index("principal", e.principal),
                self._index("session", e.session_id or ""),
                self._index("kind", e.kind),
            ]
            args += [
                e.id,
                e.model_dump_json(exclude={"seq"}),
                repr(e.time),
                "1" if e.session_id else "0",
            ]
        with self._errors():
            await self._append(keys=keys, args=args)

    async def query_events(self, query: AuditQuery) -> list[AuditEvent]:
        return (await self.query_page(query)).events

    async def query_page(self, query: AuditQuery) -> AuditPage:
        indexes = await self._narrowest(query)
        cursor = float(query.before_seq) if query.before_seq is not None else float("inf")
        found: list[AuditEvent] = []
        scanned = 0
        while True:
            ids = await self._newest_below(indexes, cursor)
            if not ids:
                return AuditPage(events=found)
            for event in await self._events(ids):
                assert event.seq is not None
                cursor = event.seq
                scanned += 1
                if query.since is not None and event.time < query.since - SINCE_SLACK_S:
                    return AuditPage(events=found)
                if _matches(event, query):
                    found.append(event)
                    if len(found) == query.limit:
                        return AuditPage(events=found, next_before=event.seq)
            cursor = min(cursor, ids[-1][1])
            if scanned >= self._max_scanned:
                return AuditPage(events=found, next_before=int(cursor))

    async def _narrowest(self, query: AuditQuery) -> list[str]:
        """The indexes to walk: the one (or, for kinds, the union) holding fewest events."""
        options: list[list[str]] = []
        for field, value in (
            ("session", query.session_id),
            ("owner", query.owner),
            ("principal", query.principal),
        ):
            if value is not None:
                options.append([self._index(field, value)])
        if query.kinds:
            options.append([self._index("kind", k) for k in dict.fromkeys(query.kinds)])
        if not options:
            return [self._key("audit", "all")]
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            for keys in options:
                for key in keys:
                    pipe.zcard(key)
            sizes = iter(cast(list[int], await pipe.execute()))
        totals = [sum(next(sizes) for _ in keys) for keys in options]
        return options[totals.index(min(totals))]

    async def _newest_below(self, indexes: list[str], below: float) -> list[tuple[str, int]]:
        """(id, seq) of up to a page of the newest events below seq `below` in the union of
        `indexes`, newest first; only those no unread event of another index comes between."""
        top = "+inf" if below == float("inf") else f"({int(below)}"
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            for key in indexes:
                pipe.zrevrangebyscore(key, top, "-inf", start=0, num=_PAGE, withscores=True)
            pages = cast(list[list[tuple[bytes, float]]], await pipe.execute())
        merged: list[tuple[str, int]] = []
        floor = float("-inf")  # below it, some index may hold events not read yet
        for page in pages:
            if len(page) == _PAGE:
                floor = max(floor, page[-1][1])
            merged += [(raw.decode(), int(score)) for raw, score in page]
        merged.sort(key=lambda pair: pair[1], reverse=True)
        return [pair for pair in merged if pair[1] >= floor]

    async def _events(self, ids: list[tuple[str, int]]) -> list[AuditEvent]:
        """The events of these ids, with their seqs; those gone meanwhile or corrupt skipped."""
        with self._errors():
            docs = cast(
                list[bytes | None],
                await self._redis.hmget(self._key("audit", "doc"), [i for i, _ in ids]),
            )
        events: list[AuditEvent] = []
        for (event_id, seq), raw in zip(ids, docs, strict=True):
            if raw is None:
                continue
            try:
                events.append(AuditEvent.model_validate_json(raw).model_copy(update={"seq": seq}))
            except ValidationError:
                log.error("the audit event %s in the shared store is corrupt (skipped)", event_id)
        return events

    async def delete_events_before(self, t: float) -> int:
        gone = 0
        while True:
            with self._errors():
                raw = cast(
                    list[bytes],
                    await self._redis.zrangebyscore(
                        self._key("audit", "time"), "-inf", f"({t!r}", start=0, num=_PAGE
                    ),
                )
            if not raw:
                return gone
            gone += await self._remove([r.decode() for r in raw])

    async def keep_newest(self, most: int) -> int:
        gone = 0
        while True:
            with self._errors():
                excess = int(await self._redis.zcard(self._key("audit", "all"))) - most
                if excess <= 0:
                    return gone
                raw = cast(
                    list[bytes],
                    await self._redis.zrange(self._key("audit", "all"), 0, min(excess, _PAGE) - 1),
                )
            if not raw:
                return gone
            gone += await self._remove([r.decode() for r in raw])

    async def _remove(self, ids: list[str]) -> int:
        """Remove these events from the log and every index naming them."""
        doc_key = self._key("audit", "doc")
        with self._errors():
            docs = cast(list[bytes | None], await self._redis.hmget(doc_key, ids))
            pipe = self._redis.pipeline(transaction=False)
            for event_id, raw in zip(ids, docs, strict=True):
                try:
                    event = AuditEvent.model_validate_json(raw) if raw is not None else None
                except ValidationError:
                    event = None  # its indexes keep a dangling id, skipped when listed
                if event is not None:
                    pipe.zrem(self._index("owner", event.owner), event_id)
                    pipe.zrem(self._index("principal", event.principal), event_id)
                    if event.session_id:
                        pipe.zrem(self._index("session", event.session_id), event_id)
                    pipe.zrem(self._index("kind", event.kind), event_id)
            pipe.zrem(self._key("audit", "all"), *ids)
            pipe.zrem(self._key("audit", "time"), *ids)
            pipe.hdel(doc_key, *ids)
            await pipe.execute()
        return sum(1 for raw in docs if raw is not None)


def _matches(event: AuditEvent, query: AuditQuery) -> bool:
    return (
        (query.owner is None or event.owner == query.owner)
        and (query.principal is None or event.principal == query.principal)
        and (query.session_id is None or event.session_id == query.session_id)
        and (not query.kinds or event.kind in query.kinds)
        and (query.since is None or event.time >= query.since)
        and (query.until is None or event.time < query.until)
    )
