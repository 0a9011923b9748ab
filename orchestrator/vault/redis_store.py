"""Sealed secrets in the Redis a cluster's replicas share: a hash per owner
(`vault:<owner>`: name -> the record's JSON). A put is one Lua script, so the per-key cap holds
whichever replica stores."""

from __future__ import annotations

from orchestrator.state_store.redis_connection import RedisConnection, text
from orchestrator.vault.records import SecretRecord, SecretsFull
from orchestrator.vault.store import VaultStore

# KEYS: the owner's hash. ARGV: name, the record's JSON without its `created_at`, the cap, the
# `created_at` of a new record. A replacement keeps the stored one, read in the script (never
# before it: two replicas replacing at once would otherwise race), written back exactly (%.17g
# round-trips a double); a stored record that does not read gets the new time. Returns "new",
# "replaced" or "full".
_PUT = """
local earlier = redis.call('HGET', KEYS[1], ARGV[1])
if not earlier and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'full' end
local created = ARGV[4]
if earlier then
  local ok, doc = pcall(cjson.decode, earlier)
  if ok and type(doc) == 'table' and type(doc['created_at']) == 'number' then
    created = string.format('%.17g', doc['created_at'])
  end
end
local rest = string.sub(ARGV[2], 2)
local sep = ','
if rest == '}' then sep = '' end
redis.call('HSET', KEYS[1], ARGV[1], '{"created_at":' .. created .. sep .. rest)
if earlier then return 'replaced' end
return 'new'
"""


class RedisVault(VaultStore):
    def __init__(self, connection: RedisConnection) -> None:
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self._put = self._redis.register_script(_PUT)

    async def put(self, record: SecretRecord, max_per_owner: int) -> bool:
        keys = [self._key("vault", record.owner)]
        doc = record.model_dump_json(exclude={"created_at"})
        args: list[str | int] = [record.name, doc, max_per_owner, repr(record.created_at)]
        with self._errors():
            answer = text(await self._put(keys=keys, args=args))
        if answer == "full":
            raise SecretsFull(f"this key holds {max_per_owner} secrets, the most it may")
        return answer == "replaced"

    async def get(self, owner: str, name: str) -> SecretRecord | None:
        with self._errors():
            doc = await self._redis.hget(self._key("vault", owner), name)
        return None if doc is None else SecretRecord.model_validate_json(doc)

    async def owned(self, owner: str) -> list[SecretRecord]:
        with self._errors():
            docs = await self._redis.hgetall(self._key("vault", owner))
        records = [SecretRecord.model_validate_json(d) for d in docs.values()]
        return sorted(records, key=lambda r: r.name)

    async def delete(self, owner: str, name: str) -> bool:
        with self._errors():
            return bool(await self._redis.hdel(self._key("vault", owner), name))

    async def close(self) -> None:
        """The connection is the service's, closed with its other stores."""
