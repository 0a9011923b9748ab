"""Kept outputs in cluster mode: in the Redis every replica shares, so an execution's JSON and its
images are fetched through any replica (no sticky routing), and outlive the replica that ran it.

The same quotas and order as on one machine (outputs.py): bytes per session and in all, the oldest
evicted first (that session's, then anyone's), an image kept once while any kept execution shows
it, an evicted id answered 410. A save stages its parts first (in pieces, with a time to live),
then one Lua script checks, evicts and renames them into place atomically, whichever replica
sends it: the quotas hold across replicas, nothing is ever half-kept, and no script carries a
payload (the store stays responsive to the other replicas during a large save). The save is done
before its id is answered, so any replica reads it at once. The quota on all kept outputs is
memory of that Redis: size it for `outputs_max_bytes_total` (docs/cluster.md).

Under `<prefix>:out`: `all` (a sorted set of `session/execution`, in save order), `seq`, `bytes`,
`t:<token>:...` (a save's staged parts); per session under `s:<session>`: `order` (its
executions, oldest first), `meta` (an execution's JSON size and images), `refs` and `sizes` (each
image's users and size), `bytes`, `gone` and `gone-order` (why an id is not kept: the last
`_GONE_REMEMBERED`), `dropped` (the session ended: a late save keeps nothing), `x:<execution>`
(its JSON) and `a:<image>.<ext>` (an image's bytes). The scripts name keys they compute, so the
store is one Redis (standalone, or a primary with replicas), not a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from code_interpreter_wire.results import Execution
from orchestrator.json_responses import encode_large
from orchestrator.outputs import (
    CHUNK_BYTES,
    IMAGE_TYPES,
    ITEM_ID,
    UNWRITTEN,
    WRITES_PENDING,
    KeptBytes,
    KeptImage,
    KeptOutputs,
    KeptValue,
    OutputNotFound,
)
from orchestrator.state_store.redis_connection import RedisConnection, StoreUnavailable, text

log = logging.getLogger(__name__)

_GONE_REMEMBERED = 10_000  # ids per session still answered "evicted" (410), not "not found"
_GONE_KEPT_S = 7 * 24 * 3600  # ...for this long after the last: a never-ended session's go too
_DROPPED_S = 3600  # how long an ended session's late saves are refused
_READ_WHOLE = 4 << 20  # larger JSON is read in chunks (an eviction meanwhile cuts it short)
_UNWRITTEN_REMEMBERED = 10_000
_UNDROPPED_REMEMBERED = 10_000  # ended sessions whose drop the store refused, tried again later
_UNDROPPED_RETRIED = 8  # ...at most this many at each later save or drop
_STAGED_S = 600  # a staged part not taken in by its save by then (its replica died) expires
_STAGED_CHUNK = 1 << 20  # staged in pieces: each call on the store stays short

# Why an id is not kept: the last `_GONE_REMEMBERED` per session (the oldest forgotten first),
# for `_GONE_KEPT_S` after the last. Both scripts below remember alike.
_REMEMBER = f"""
local function at(session) return base .. ':s:' .. session end
local function remember(session, id, why)
  local gone, order = at(session) .. ':gone', at(session) .. ':gone-order'
  if redis.call('HSET', gone, id, why) == 1 then
    redis.call('RPUSH', order, id)
    if redis.call('LLEN', order) > remembered then
      redis.call('HDEL', gone, redis.call('LPOP', order))
    end
  end
  redis.call('EXPIRE', gone, {_GONE_KEPT_S})
  redis.call('EXPIRE', order, {_GONE_KEPT_S})
end
"""

_REFUSED = (
    """
local base, sid, eid, why, remembered = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
"""
    + _REMEMBER
    + """
remember(sid, eid, why)
return 1
"""
)

# A save: its parts were staged under `t:<token>` (written in pieces, with a time to live);
# the script judges the quotas, evicts, and renames what is kept into place, so it never holds
# the payload and runs in the time of its bookkeeping, whatever the size.
_SAVE = (
    """
local base, sid, eid, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_session, max_total = tonumber(ARGV[5]), tonumber(ARGV[6])
local remembered, images, json = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
"""
    + _REMEMBER
    + """local function evict(session)
  local s = at(session)
  local id = redis.call('LPOP', s .. ':order')
  if not id then return nil end
  local meta = redis.call('HGET', s .. ':meta', id) or '0'
  redis.call('HDEL', s .. ':meta', id)
  redis.call('ZREM', base .. ':all', session .. '/' .. id)
  redis.call('DEL', s .. ':x:' .. id)
  remember(session, id, 'evicted')
  local freed, first = 0, true
  for part in string.gmatch(meta, '[^|]+') do
    if first then
      freed, first = tonumber(part), false
    elseif redis.call('HINCRBY', s .. ':refs', part, -1) <= 0 then
      freed = freed + tonumber(redis.call('HGET', s .. ':sizes', part) or '0')
      redis.call('HDEL', s .. ':refs', part)
      redis.call('HDEL', s .. ':sizes', part)
      redis.call('DEL', s .. ':a:' .. part)
      remember(session, string.match(part, '^[^.]*'), 'evicted')
    end
  end
  if redis.call('DECRBY', s .. ':bytes', freed) <= 0 then redis.call('DEL', s .. ':bytes') end
  redis.call('DECRBY', base .. ':bytes', freed)
  return id
end

local here, staged = at(sid), base .. ':t:' .. token
local function unstage()
  redis.call('DEL', staged .. ':x')
  for i = 1, images do redis.call('DEL', staged .. ':a:' .. ARGV[8 + 2 * i]) end
end
if redis.call('EXISTS', here .. ':dropped') == 1 then unstage() return 'dropped' end
if redis.call('HEXISTS', here .. ':meta', eid) == 1 then unstage() return 'kept' end
-- Each part whole, or the save is lost (one that expired while staged, even partly).
if redis.call('STRLEN', staged .. ':x') ~= json then unstage() return 'lost' end
local names, new, size = {}, {}, json
for i = 1, images do
  local name, bytes = ARGV[8 + 2 * i], tonumber(ARGV[9 + 2 * i])
  names[#names + 1] = name
  if redis.call('HEXISTS', here .. ':refs', name) == 0 then
    local part = staged .. ':a:' .. name
    if redis.call('EXISTS', part) == 0 or redis.call('STRLEN', part) ~= bytes then
      unstage()
      return 'lost'
    end
    new[name] = bytes
    size = size + bytes
  end
end
if size > math.min(max_session, max_total) then
  remember(sid, eid, 'its ' .. size .. ' bytes are over the quota')
  unstage()
  return 'over'
end
for _, name in ipairs(names) do
  if redis.call('HINCRBY', here .. ':refs', name, 1) == 1 then
    redis.call('HSET', here .. ':sizes', name, new[name])
  end
end
names[0] = tostring(json)
redis.call('HSET', here .. ':meta', eid, table.concat(names, '|', 0))
redis.call('RPUSH', here .. ':order', eid)
redis.call('ZADD', base .. ':all', redis.call('INCR', base .. ':seq'), sid .. '/' .. eid)
redis.call('INCRBY', here .. ':bytes', size)
redis.call('INCRBY', base .. ':bytes', size)
local itself = false
while tonumber(redis.call('GET', here .. ':bytes') or '0') > max_session do
  local id = evict(sid)
  if not id then break end
  if id == eid then itself = true end
end
while tonumber(redis.call('GET', base .. ':bytes')) > max_total do
  local oldest = redis.call('ZRANGE', base .. ':all', 0, 0)[1]
  if not oldest then break end
  local session = string.match(oldest, '^(.*)/')
  local id = evict(session)
  if not id then
    redis.call('ZREM', base .. ':all', oldest)
  elseif session == sid and id == eid then
    itself = true
  end
end
if itself then unstage() return 'evicted' end
redis.call('RENAME', staged .. ':x', here .. ':x:' .. eid)
redis.call('PERSIST', here .. ':x:' .. eid)
for name, _ in pairs(new) do
  redis.call('RENAME', staged .. ':a:' .. name, here .. ':a:' .. name)
  redis.call('PERSIST', here .. ':a:' .. name)
end
unstage()
return 'kept'
"""
)

_DROP = """
local base, sid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local here = base .. ':s:' .. sid
redis.call('SET', here .. ':dropped', '1', 'EX', ttl)
for _, id in ipairs(redis.call('LRANGE', here .. ':order', 0, -1)) do
  redis.call('ZREM', base .. ':all', sid .. '/' .. id)
  redis.call('DEL', here .. ':x:' .. id)
end
for _, name in ipairs(redis.call('HKEYS', here .. ':refs')) do
  redis.call('DEL', here .. ':a:' .. name)
end
redis.call('DECRBY', base .. ':bytes', tonumber(redis.call('GET', here .. ':bytes') or '0'))
redis.call('DEL', here .. ':order', here .. ':meta', here .. ':refs', here .. ':sizes',
  here .. ':bytes', here .. ':gone', here .. ':gone-order')
return 1
"""


class SharedOutputStore(KeptOutputs):
    def __init__(
        self,
        connection: RedisConnection,
        *,
        max_bytes_per_session: int = 256 << 20,
        max_bytes_total: int = 4 << 30,
    ) -> None:
        self._connection = connection
        self._redis = connection.client
        self.max_bytes_per_session = max_bytes_per_session
        self.max_bytes_total = max_bytes_total
        self._base = connection.key("out")
        self._save = self._redis.register_script(_SAVE)
        self._drop = self._redis.register_script(_DROP)
        self._refused = self._redis.register_script(_REFUSED)
        self._slots = asyncio.Semaphore(WRITES_PENDING)  # saves' encodings held at once
        # Saves the store refused (it was down): told here as not kept, not as unknown.
        self._unwritten: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._undropped: OrderedDict[str, None] = OrderedDict()  # oldest first

    def _key(self, session_id: str, *parts: str) -> str:
        return ":".join((self._base, "s", session_id, *parts))

    def clear(self) -> None:
        """Nothing: the store outlives each replica, and the sessions whose outputs it holds."""

    async def save(self, session_id: str, execution: Execution) -> str:
        """Kept (or refused, told to readers) before the id is answered: any replica reads it."""
        execution_id = f"e-{secrets.token_hex(8)}"
        if not ITEM_ID.match(session_id):
            raise OutputNotFound(f"no session {session_id}")
        async with self._slots:
            data = await asyncio.to_thread(encode_large, execution.model_dump(mode="json"))
            images = {f"{a.id}.{a.extension}": a.data for a in execution.artifacts}
            # What can never fit (an image kept already counts nothing, so only each part on
            # its own is sure to be over): the store's script judges the rest.
            size = max([len(data), *(len(blob) for blob in images.values())])
            if size > min(self.max_bytes_per_session, self.max_bytes_total):
                # Never sent: no use moving it through the store only to be refused there.
                why = f"its {len(data)} bytes and images are over the quota"
                with contextlib.suppress(StoreUnavailable), self._connection.errors():
                    await self._refused(
                        args=[self._base, session_id, execution_id, why, _GONE_REMEMBERED]
                    )
                return execution_id
            token = secrets.token_hex(8)
            staged = f"{self._base}:t:{token}"
            parts = {f"{staged}:x": data} | {f"{staged}:a:{n}": b for n, b in images.items()}
            args: list[Any] = [self._base, session_id, execution_id, token]
            args += [self.max_bytes_per_session, self.max_bytes_total, _GONE_REMEMBERED]
            args += [len(images), len(data)]
            for name, blob in images.items():
                args += [name, len(blob)]
            try:
                with self._connection.errors():
                    for key, blob in parts.items():
                        await self._stage(key, blob)
                    answer = text(await self._save(args=args))
            except BaseException as exc:
                # Staged parts go now, not at their time to live (best effort: else then).
                with contextlib.suppress(Exception):
                    await self._redis.delete(*parts)
                if not isinstance(exc, StoreUnavailable):
                    raise
                answer = f"lost: {exc}"
            if answer.startswith("lost"):
                # The store was down, or so slow that what was staged expired before the save.
                log.error("an output of session %s was not kept: %s", session_id, answer)
                why = f"{UNWRITTEN}: {answer}"
                for item in [execution_id] + [a.id for a in execution.artifacts]:
                    self._unwritten[(session_id, item)] = why
                while len(self._unwritten) > _UNWRITTEN_REMEMBERED:
                    self._unwritten.popitem(last=False)
                return execution_id
        await self._drop_again()
        return execution_id

    async def _stage(self, key: str, data: bytes) -> None:
        """Written in pieces, so no one call is long (the store's timeout holds for each, and
        other replicas' calls go between them), with a time to live: a replica that dies
        midway leaves nothing behind for long."""
        view = memoryview(data)
        await self._redis.set(key, bytes(view[:_STAGED_CHUNK]), ex=_STAGED_S)
        for start in range(_STAGED_CHUNK, len(view), _STAGED_CHUNK):
            # With its time to live again: a piece after an expiry never stays for ever (the
            # script then finds the part short, and the save lost).
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.append(key, bytes(view[start : start + _STAGED_CHUNK]))
                pipe.expire(key, _STAGED_S)
                await pipe.execute()

    async def settled(self, session_id: str, item_id: str) -> None:
        """At once: a save is done before its id is given out."""

    async def _missing(self, session_id: str, what: str, item_id: str) -> Exception:
        """Why the store has no such item; a save it seemed to refuse (a timeout: the outcome is
        unknown) is told as not kept only when the store has no word of it either."""
        with self._connection.errors():
            answer = await self._redis.hget(self._key(session_id, "gone"), item_id)
        why = None if answer is None else text(answer)
        if why is None:
            why = self._unwritten.get((session_id, item_id))
        return self.missing(session_id, what, item_id, why)

    async def open_execution(self, session_id: str, execution_id: str) -> KeptBytes:
        if not ITEM_ID.match(session_id) or not ITEM_ID.match(execution_id):
            raise OutputNotFound(f"no execution {execution_id} in session {session_id}")
        key = self._key(session_id, "x", execution_id)
        with self._connection.errors():
            size = int(await self._redis.strlen(key))
            if 0 < size <= _READ_WHOLE:
                data = await self._redis.get(key)
                if data is not None:
                    return KeptValue(_raw(data))
            elif size:
                return _KeptChunks(self._connection, key, size)
        raise await self._missing(session_id, "execution", execution_id)

    async def artifact(self, session_id: str, artifact_id: str) -> KeptImage:
        if not ITEM_ID.match(session_id) or not ITEM_ID.match(artifact_id):
            raise OutputNotFound(f"no artifact {artifact_id} in session {session_id}")
        keys = [self._key(session_id, "a", f"{artifact_id}.{ext}") for ext in IMAGE_TYPES]
        with self._connection.errors():
            found = await self._redis.mget(keys)
        for mime, data in zip(IMAGE_TYPES.values(), found, strict=True):
            if data is not None:
                return KeptImage(mime, data=_raw(data))
        raise await self._missing(session_id, "image", artifact_id)

    async def drop(self, session_id: str) -> None:
        """Never fails the session's end: if the store is down, the drop is tried again at this
        replica's next save or drop once it answers (what it kept meanwhile counts in the quota
        in all, so the oldest of it goes first when room is needed)."""
        if not ITEM_ID.match(session_id):
            return
        if await self._dropped(session_id):
            await self._drop_again()

    async def _dropped(self, session_id: str) -> bool:
        try:
            with self._connection.errors():
                await self._drop(args=[self._base, session_id, _DROPPED_S])
        except StoreUnavailable as exc:
            log.error("the kept outputs of ended session %s stay for now: %s", session_id, exc)
            self._undropped[session_id] = None
            while len(self._undropped) > _UNDROPPED_REMEMBERED:
                self._undropped.popitem(last=False)
            return False
        return True

    async def _drop_again(self) -> None:
        """The store answers again: the drops it refused, a few at a time (saves and drops
        call this at once: each takes its own from the list)."""
        for _ in range(_UNDROPPED_RETRIED):
            if not self._undropped:
                return
            session_id, _ = self._undropped.popitem(last=False)
            try:
                dropped = await self._dropped(session_id)
            except BaseException:  # cancelled: tried again later
                self._undropped[session_id] = None
                raise
            if not dropped:
                return

    async def close(self) -> None:
        """Nothing: each save is done before its caller goes on."""


class _KeptChunks(KeptBytes):
    """A large one, read in chunks from where it is kept (never copied: copies would be
    memory outside the quota); an eviction meanwhile cuts the read short."""

    def __init__(self, connection: RedisConnection, key: str, size: int) -> None:
        self._connection = connection
        self._key = key
        self.size = size

    async def chunks(self) -> AsyncIterator[bytes]:
        redis = self._connection.client
        for start in range(0, self.size, CHUNK_BYTES):
            with self._connection.errors():
                chunk = await redis.getrange(self._key, start, start + CHUNK_BYTES - 1)
            if not chunk:  # evicted under its reader
                return
            yield _raw(chunk)

    async def close(self) -> None:
        """Nothing is held."""


def _raw(answer: bytes | str) -> bytes:
    """A value as stored (the connection never decodes; typed as if it might)."""
    return answer if isinstance(answer, bytes) else answer.encode()
