"""What the replicas of a cluster agree on through the shared Redis, beside the session records
(orchestrator/state_store/redis_store.py): places under the caps, the claim that makes each end
happen once, and the tombstones every replica answers an ended session with.

Admission is a Lua script rather than MULTI/WATCH: the check and the reservation are one step on
the server, so concurrent creates through many replicas neither pass the cap nor abort and retry
(WATCH would make every loser of a race go round again, under exactly the load caps are for).
An end is one script too: the claim, the tombstone and the place given back together, so no
replica can die between them and leave a claim that ends nothing.

Keys, under the store's prefix: `slots` (every reserved place, a set), `owner-slots:<owner>`
(a set), `slot-details` (a hash: session id -> `Slot`), `claim:<id>`, `ended:<id>`
(`Tombstone`, expiring after `tombstone_ttl_s`), and `session:<id>` read to find abandoned slots.
"""

from __future__ import annotations

import logging
import time
from typing import cast

from pydantic import BaseModel

from orchestrator.state_store.redis_connection import (
    PAGE,
    CorruptRecord,
    RedisConnection,
    load,
    text,
)

log = logging.getLogger(__name__)


class Tombstone(BaseModel):
    """An ended session: whose it was and why it ended (told as 410 by every replica)."""

    owner: str
    why: str


class Slot(BaseModel):
    """A reserved place under the caps: whose, and since when (to give back abandoned ones)."""

    owner: str
    at: float


# Reserve a slot for ARGV[1] unless a cap is reached: returns "ok", or "total:N" / "key:N".
# KEYS: every slot (set), the owner's slots (set), the slots' details (hash).
# ARGV: session id, cap per key, cap in total, the slot's JSON.
_ADMIT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 'ok' end
local total = redis.call('SCARD', KEYS[1])
if total >= tonumber(ARGV[3]) then return 'total:' .. total end
local mine = redis.call('SCARD', KEYS[2])
if mine >= tonumber(ARGV[2]) then return 'key:' .. mine end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
return 'ok'
"""

# End a session once across replicas. Returns "won", or the tombstone's JSON (a loser: someone
# ended it first; "" if it lapsed).
# KEYS: the claim, the tombstone, every slot (set), the owner's slots (set), the slots' details.
# ARGV: session id, the tombstone's JSON, claim TTL (s), tombstone TTL (s).
_END = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  return redis.call('GET', KEYS[2]) or ''
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[4]))
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 'won'
"""


class CoordinationStore:
    def __init__(
        self,
        connection: RedisConnection,
        *,
        tombstone_ttl_s: float = 86400.0,
        max_lifetime_s: float = 86400.0,
        max_listed: int = 10_000,
    ) -> None:
        """`connection`: the shared Redis. `max_lifetime_s`: the longest a session lives (an
        end's claim outlasts it and its tombstone, so no late end goes round again).
        `max_listed`: the most slots one sweep for abandoned ones looks at."""
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self._ttl = max(1, int(tombstone_ttl_s))
        self._claim_ttl = self._ttl + max(1, int(max_lifetime_s)) + 60
        self._max_listed = max_listed
        self._admit = self._redis.register_script(_ADMIT)
        self._end = self._redis.register_script(_END)

    # --- admission under the caps, shared by every replica
    async def admit(self, owner: str, session_id: str, per_key: int, total: int) -> str | None:
        """Reserve a place for a session about to be made: None, or why it cannot (which cap,
        how many). Reserving an id twice is one reservation."""
        slot = Slot(owner=owner, at=time.time()).model_dump_json()
        with self._errors():
            answer = await self._admit(
                keys=[
                    self._key("slots"),
                    self._key("owner-slots", owner),
                    self._key("slot-details"),
                ],
                args=[session_id, per_key, total, slot],
            )
        verdict = text(answer)
        if verdict == "ok":
            return None
        which, _, count = verdict.partition(":")
        if which == "total":
            return (
                f"the service holds its maximum of {total} sessions ({count} across its "
                "replicas); close one or try again later"
            )
        return f"this API key holds its maximum of {per_key} sessions ({count}); delete one first"

    async def release(self, session_id: str) -> None:
        """Give a session's place back (it ended, or was never made). Idempotent."""
        details = self._key("slot-details")
        with self._errors():
            raw = cast(bytes | None, await self._redis.hget(details, session_id))
        slot = None
        try:
            slot = load(Slot, raw, f"{details}[{session_id}]")
        except CorruptRecord as exc:
            log.error("%s (released all the same)", exc)
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.srem(self._key("slots"), session_id)
            if slot is not None:
                pipe.srem(self._key("owner-slots", slot.owner), session_id)
            pipe.hdel(details, session_id)
            await pipe.execute()

    async def slots_held(self, owner: str | None = None) -> int:
        """How many places are taken: in total, or by one owner."""
        key = self._key("owner-slots", owner) if owner is not None else self._key("slots")
        with self._errors():
            return int(await self._redis.scard(key))

    async def abandoned_slots(self, older_than_s: float, most: int) -> list[str]:
        """Places reserved over `older_than_s` ago whose session has no record: a replica died
        between reserving and recording. At most `most`."""
        cutoff = time.time() - older_than_s
        found: list[str] = []
        details = self._key("slot-details")
        old: list[str] = []
        with self._errors():
            async for sid_raw, raw in self._redis.hscan_iter(details, count=PAGE):
                sid = sid_raw.decode()
                try:
                    slot = load(Slot, raw, f"{details}[{sid}]")
                except CorruptRecord:
                    slot = None
                if slot is None or slot.at < cutoff:
                    old.append(sid)
                if len(old) >= self._max_listed:
                    break
            for start in range(0, len(old), PAGE):  # one round trip per page, not per slot
                page = old[start : start + PAGE]
                pipe = self._redis.pipeline(transaction=False)
                for sid in page:
                    pipe.exists(self._key("session", sid))
                found += [sid for sid, n in zip(page, await pipe.execute(), strict=True) if not n]
                if len(found) >= most:
                    break
        return found[:most]

    # --- ends: once across replicas, and remembered by all
    async def end(self, session_id: str, owner: str, why: str) -> tuple[bool, str]:
        """End a session in the store, once whichever replicas ask: the claim, the tombstone
        (every replica answers "ended, why" from now on) and its place given back, in one
        atomic step. Returns (whether this caller won, why it ended as the tombstone says)."""
        value = Tombstone(owner=owner, why=why).model_dump_json()
        with self._errors():
            answer = await self._end(
                keys=[
                    self._key("claim", session_id),
                    self._key("ended", session_id),
                    self._key("slots"),
                    self._key("owner-slots", owner),
                    self._key("slot-details"),
                ],
                args=[session_id, value, self._claim_ttl, self._ttl],
            )
        raw = answer if isinstance(answer, bytes) else str(answer).encode()
        if raw == b"won":
            return True, why
        try:
            found = load(Tombstone, raw or None, self._key("ended", session_id))
        except CorruptRecord as exc:
            log.error("%s (ended all the same)", exc)
            found = None
        return False, found.why if found is not None else why

    async def ended(self, session_id: str) -> tuple[str, str] | None:
        """(owner, why) of an ended session, or None."""
        key = self._key("ended", session_id)
        with self._errors():
            raw = cast(bytes | None, await self._redis.get(key))
        found = load(Tombstone, raw, key)
        return (found.owner, found.why) if found is not None else None

    async def ended_with(
        self, session_id: str, key: str
    ) -> tuple[tuple[str, str] | None, bytes | None]:
        """`ended`, and the raw value of another key of the same store, in one round trip (a
        call on a cached session checks both)."""
        tombstone = self._key("ended", session_id)
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(tombstone)
            pipe.get(key)
            raw, other = cast(list[bytes | None], await pipe.execute())
        found = load(Tombstone, raw, tombstone)
        return ((found.owner, found.why) if found is not None else None), other

    async def ended_among(self, session_ids: list[str]) -> dict[str, tuple[str, str]]:
        """Which of these sessions ended: id -> (owner, why). Corrupt tombstones are skipped."""
        ended: dict[str, tuple[str, str]] = {}
        for start in range(0, len(session_ids), PAGE):
            page = session_ids[start : start + PAGE]
            keys = [self._key("ended", i) for i in page]
            with self._errors():
                values = cast(list[bytes | None], await self._redis.mget(keys))
            for session_id, key, raw in zip(page, keys, values, strict=True):
                try:
                    found = load(Tombstone, raw, key)
                except CorruptRecord as exc:
                    log.error("%s (skipped)", exc)
                    continue
                if found is not None:
                    ended[session_id] = (found.owner, found.why)
        return ended
