"""Keys as principals in the Redis every replica shares (cluster mode).

Layout, under the store's prefix:
- `principal:<id>`: the principal's JSON (its key digests among it; never a key);
- `principal-names`, a hash: name -> id (names are unique);
- `principal-keys`, a hash: key digest -> id (a key found in one read);
- `principal-digests:<id>`, a set: the digests of one principal (to drop them on a rotation).
A put is one Lua script, atomic whichever replica or CLI sends it: a name held by another
principal is refused, never taken over.

Every replica reads the whole table about once a second (`Principals`): one HGETALL and one
MGET, whatever the number of keys.
"""

from __future__ import annotations

import logging
from typing import cast

from pydantic import ValidationError

from orchestrator.governance.stores.principal_store import (
    PrincipalNameTaken,
    PrincipalRecord,
    PrincipalStore,
)
from orchestrator.state_store.redis_connection import RedisConnection, text

log = logging.getLogger(__name__)
_PAGE = 200  # records read per MGET

# KEYS: the record, the names hash, the digests hash, this principal's digests (set).
# ARGV: id, name, the record's JSON, then each key digest. Returns "ok" or "taken".
_PUT = """
local holder = redis.call('HGET', KEYS[2], ARGV[2])
if holder and holder ~= ARGV[1] then return 'taken' end
local previous = redis.call('GET', KEYS[1])
if previous then
  local old_name = cjson.decode(previous)['name']
  if old_name ~= ARGV[2] then redis.call('HDEL', KEYS[2], old_name) end
end
for _, digest in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  redis.call('HDEL', KEYS[3], digest)
end
redis.call('DEL', KEYS[4])
redis.call('SET', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
for i = 4, #ARGV do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[1])
  redis.call('SADD', KEYS[4], ARGV[i])
end
return 'ok'
"""


class RedisPrincipals(PrincipalStore):
    def __init__(self, connection: RedisConnection) -> None:
        """`connection`: the shared Redis (its client, key prefix and failures)."""
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self._put = self._redis.register_script(_PUT)

    async def put_principal(self, record: PrincipalRecord) -> None:
        keys = [
            self._key("principal", record.id),
            self._key("principal-names"),
            self._key("principal-keys"),
            self._key("principal-digests", record.id),
        ]
        args = [record.id, record.name, record.model_dump_json(), *(k.digest for k in record.keys)]
        with self._errors():
            answer = await self._put(keys=keys, args=args)
        if text(answer) == "taken":
            raise PrincipalNameTaken(f"a key named {record.name!r} exists")

    async def _by_id(self, principal_id: str | None) -> PrincipalRecord | None:
        if principal_id is None:
            return None
        with self._errors():
            raw = cast(bytes | None, await self._redis.get(self._key("principal", principal_id)))
        return PrincipalRecord.model_validate_json(raw) if raw is not None else None

    async def _id_in(self, hash_name: str, field: str) -> str | None:
        with self._errors():
            raw = cast(bytes | None, await self._redis.hget(self._key(hash_name), field))
        return raw.decode() if raw is not None else None

    async def get_principal(self, name: str) -> PrincipalRecord | None:
        return await self._by_id(await self._id_in("principal-names", name))

    async def principal_by_id(self, principal_id: str) -> PrincipalRecord | None:
        return await self._by_id(principal_id)

    async def principal_by_digest(self, digest: str) -> PrincipalRecord | None:
        return await self._by_id(await self._id_in("principal-keys", digest))

    async def principals(self) -> list[PrincipalRecord]:
        with self._errors():
            names = cast(
                dict[bytes, bytes], await self._redis.hgetall(self._key("principal-names"))
            )
        ids = sorted(set(v.decode() for v in names.values()))
        found: list[PrincipalRecord] = []
        for start in range(0, len(ids), _PAGE):
            keys = [self._key("principal", i) for i in ids[start : start + _PAGE]]
            with self._errors():
                values = cast(list[bytes | None], await self._redis.mget(keys))
            for key, value in zip(keys, values, strict=True):
                try:
                    found += [PrincipalRecord.model_validate_json(value)] if value else []
                except ValidationError as exc:  # one bad value hides no other key
                    log.error("the principal at %r is corrupt (skipped): %s", key, exc)
        return sorted(found, key=lambda r: r.name)
